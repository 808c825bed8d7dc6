"""The ``server`` backend: any OpenAI-compatible server, started by its command line.

As llama-swap's ``cmd``: the operator gives the ``command`` (``${PORT}`` and
``${MODEL_PATH}`` substituted), its ``env``, the ``kind`` of model it serves and the
``routes`` it answers. Each replica is one such process under the same supervision as
``llama_server`` and ``vllm_serve`` (pool/backends/_managed.py, _process.py: its own
process group, a guard that ends the group when the pool dies, readiness by its
``health_path``, the VRAM it took measured through NVML after the start unless
``vram_mib`` declares it). A ``chat`` or ``embedding`` server is spoken to by the pool's
upstream client, so every surface works with it; the routes of the other kinds are
forwarded as they came (pool/backends/_forward.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import trio
from pydantic import Field, PositiveInt, field_validator, model_validator

from pool.backends._embedding import EmbeddingFields
from pool.backends._forward import (
    FORWARDED_KINDS,
    KIND_ROUTES,
    Forwarded,
    ReplyHead,
    forward_upstream,
)
from pool.backends._managed import SERVER_SAMPLING, ManagedServerRuntime, server_url
from pool.backends._process import ManagedProcess, child_environment, free_port
from pool.backends._protocol import (
    MODEL_KINDS,
    Backend,
    Capabilities,
    LoadContext,
    ModelKind,
)
from pool.backends._tasks import TaskSink, TaskUsage
from pool.config import CommonModelFields
from pool.errors import BackendError

# ${NAME} in the command and the environment; only these two names exist.
_PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
_KNOWN = frozenset({"PORT", "MODEL_PATH"})


class ServerModel(CommonModelFields, EmbeddingFields):
    """Any OpenAI-compatible server, started by its ``command``."""

    KINDS: ClassVar[tuple[ModelKind, ...]] = MODEL_KINDS

    backend: Literal["server"] = "server"
    command: list[str] = Field(
        min_length=1,
        description="The server's argv (no shell): `${PORT}` becomes the port the pool"
        " chose (or `port`), `${MODEL_PATH}` the resolved `model_path`.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables beside the pool's own (the same substitutions).",
    )
    host: str = Field("127.0.0.1", description="The address the server listens on.")
    port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None, description="A fixed port; default: a free one, given as `${PORT}`."
    )
    health_path: str = Field(
        "/health",
        pattern=r"^/",
        description="GET here answers 200 once the server is ready (then a chat server"
        " generates one token, an embedding server embeds one text).",
    )
    routes: list[str] | dict[str, str] | None = Field(
        None,
        description="The routes of its kind the server answers: a list of paths, or a map"
        " from the pool's path to the server's; default: every route of its kind"
        " (chat: /v1/chat/completions; embedding: /v1/embeddings; rerank: /v1/rerank and"
        " /v1/score; transcription: /v1/audio/transcriptions and /v1/audio/translations;"
        " speech: /v1/audio/speech; image: /v1/images/generations).",
    )
    served_model: str | None = Field(
        None,
        description="The `model` the server expects in a body; default: the pool's name"
        " of the model (a forwarded JSON body gets it in place of the client's).",
    )
    api_key: str | None = Field(
        None, description="Sent as the bearer token of every request to the server."
    )
    vram_mib: PositiveInt | None = Field(
        None,
        description="VRAM one replica takes, for the VRAM gate; default: measured through"
        " NVML after the start, as for the other managed servers.",
    )
    ready_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        120.0, description="The longest wait for the server to be ready after its start."
    )
    request_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        600.0, description="The longest wait for any read of a reply from the server."
    )

    @field_validator("command", "env")
    @classmethod
    def _known_placeholders(cls, value: list[str] | dict[str, str]) -> list[str] | dict[str, str]:
        for text in value if isinstance(value, list) else value.values():
            for name in _PLACEHOLDER.findall(text):
                if name not in _KNOWN:
                    raise ValueError(
                        f"unknown placeholder ${{{name}}} in {text!r}: only ${{PORT}} and"
                        " ${MODEL_PATH} are substituted"
                    )
        return value

    @model_validator(mode="after")
    def _coherent(self) -> ServerModel:
        words = [*self.command, *self.env.values()]
        if not self.command[0].strip():
            raise ValueError("command[0] must name the program to run")
        if self.port is None and not any("${PORT}" in word for word in words):
            raise ValueError(
                "the server's port is unknown: put ${PORT} in command (or env), or set port"
            )
        if self.model_path is None and any("${MODEL_PATH}" in word for word in words):
            raise ValueError("command uses ${MODEL_PATH}, but model_path is not set")
        known = KIND_ROUTES[self.kind]
        for route, upstream in self.route_map().items():
            if route not in known:
                raise ValueError(
                    f"route {route!r} is not one of kind {self.kind}'s: {', '.join(known)}"
                )
            if not upstream.startswith("/"):
                raise ValueError(f"route {route!r}: the server's path must start with /")
        return self

    def route_map(self) -> dict[str, str]:
        """The pool's path of each route served, to the server's path for it."""
        if self.routes is None:
            return {route: route for route in KIND_ROUTES[self.kind]}
        if isinstance(self.routes, list):
            return {route: route for route in self.routes}
        return dict(self.routes)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """``text`` with each ``${NAME}`` replaced by its value."""
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


class ServerRuntime(ManagedServerRuntime):
    """A managed server that also forwards the routes of its kind as they came."""

    def __init__(
        self,
        process: ManagedProcess,
        base_url: str,
        *,
        routes: Mapping[str, str],
        forwards: bool,
        **fields: Any,
    ) -> None:
        super().__init__(process, base_url, **fields)
        self._routes = dict(routes)
        self._forwards = forwards
        self._served = fields["served_model"]
        self.chat_path = self._routes.get("/v1/chat/completions", self.chat_path)
        self.embeddings_path = self._routes.get("/v1/embeddings", self.embeddings_path)

    async def forward(
        self, route: str, body: bytes, content_type: str, head: ReplyHead, sink: TaskSink
    ) -> tuple[Forwarded, TaskUsage]:
        path = self._routes.get(route) if self._forwards else None
        if path is None:
            raise BackendError(f"{self.process.label} does not serve {route}")
        if self._closed or not self.process.alive:
            raise BackendError(f"{self.process.label} is not running: {self.process.tail()[-500:]}")
        try:
            return await forward_upstream(
                self._upstream,
                path,
                self._named(body, content_type),
                content_type=content_type,
                head=head,
                sink=sink,
                headers=self._headers,
                what=self.process.label,
            )
        except BackendError as exc:
            if (exited := self._exited_error()) is not None:
                raise exited from exc
            raise

    def _named(self, body: bytes, content_type: str) -> bytes:
        """A JSON body with the server's own name of the model (a form goes as it is)."""
        if not content_type.split(";", 1)[0].strip().lower().endswith("json"):
            return body
        try:
            data = json.loads(body)
        except ValueError:
            return body
        if not isinstance(data, dict) or data.get("model") == self._served:
            return body
        data["model"] = self._served
        return json.dumps(data, ensure_ascii=False).encode()


class ServerBackend(Backend[ServerModel]):
    config = ServerModel

    def capabilities(self, definition: ServerModel) -> Capabilities:
        chat = definition.kind == "chat"
        return Capabilities(
            modalities=tuple(definition.modalities),
            multi_turn=True,
            sampling=SERVER_SAMPLING,
            kind=definition.kind,
            # Passed on in OpenAI's own fields: the server decides what it honours.
            tools=chat,
            structured_output=chat,
            forwards=frozenset(definition.route_map())
            if definition.kind in FORWARDED_KINDS
            else frozenset(),
        )

    def effective_target_inflight(self, definition: ServerModel) -> int:
        return definition.target_inflight

    def declared_vram_mib(self, definition: ServerModel) -> int | None:
        return definition.vram_mib

    async def load(self, definition: ServerModel, context: LoadContext) -> ServerRuntime:
        values = {"PORT": str(definition.port or free_port(definition.host))}
        if definition.model_path is not None:
            path = context.model_path(definition.model_path)
            if not await trio.to_thread.run_sync(path.exists):
                raise BackendError(f"model file {path} does not exist")
            values["MODEL_PATH"] = str(path)
        command = [substitute(word, values) for word in definition.command]
        env = {name: substitute(value, values) for name, value in definition.env.items()}
        label = f"model={context.model_name} server[{context.replica_index}]"
        process = ManagedProcess(
            label, command, child_environment(env, placement=context.placement)
        )
        process.spawn()
        kind = definition.kind
        runtime = ServerRuntime(
            process,
            server_url(definition.host, int(values["PORT"])),
            routes=definition.route_map(),
            forwards=kind in FORWARDED_KINDS,
            served_model=definition.served_model or context.model_name,
            request_timeout_s=definition.request_timeout_s,
            api_key=definition.api_key,
            embedding_batch=definition.embedding_batch_size if kind == "embedding" else None,
        )
        # A chat server proves itself with a token, an embedding server with a vector;
        # the other kinds have no request small and safe enough: the health answer it is.
        await runtime.wait_ready(
            definition.health_path,
            definition.ready_timeout_s,
            probe=kind in ("chat", "embedding"),
        )
        return runtime


BACKEND = ServerBackend()
