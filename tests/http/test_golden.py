"""Golden files: the exact bytes of every public API surface.

Each case starts a real server with stub models, makes its requests and compares a
transcript (request line, status line, headers and raw body of every exchange) with
``tests/http/golden/<case>.txt``. Values that change from run to run (ids, timestamps,
timings, NVML readings) are replaced by placeholders with regexes on the raw text, so
key order, spacing and number formatting stay pinned.

``UPDATE_GOLDEN=1`` (re)writes the files; without it a mismatch fails with a unified diff.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from pool import ServerInfo
from pool._version import __version__
from pool.actors import GpuReading, GpuSource

from .conftest import FakeGpus, start_server

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

PARIS = "The capital of France is Paris."
SLOW_REPLY = " ".join(f"w{i}" for i in range(200))

MODELS: dict[str, dict[str, Any]] = {
    "paris": {"backend": "stub", "enabled": True, "stub_reply": PARIS, "target_inflight": 2},
    "echo": {"backend": "stub", "enabled": True},
    "slow": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": SLOW_REPLY,
        "stub_tokens_per_second": 20,
        "max_queue": 0,
    },
    "cold": {"backend": "stub", "stub_reply": PARIS, "stub_vram_mib": 300},
    "broken": {"backend": "stub", "stub_fail_load": True},
    # Echoes its input slowly: a long input holds the one slot, a queued request times out.
    "gate": {
        "backend": "stub",
        "enabled": True,
        "stub_tokens_per_second": 20,
        "max_queue": 1,
        "queue_timeout_s": 0.2,
    },
}

# -- normalization ---------------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
# Constants that sit where clock readings usually are (Ollama's "kept forever").
_FIXED_VALUES = {'"2318-01-01T00:00:00Z"'}


def _placeholder(name: str) -> Callable[[re.Match[str]], str]:
    """Replace a JSON value, keeping its kind: ``<X>`` int, ``<X:f>`` float, ``"<X>"`` text."""

    def sub(match: re.Match[str]) -> str:
        value = match.group("value")
        if value in _FIXED_VALUES:
            return match.group(0)
        if value.startswith('"'):
            kind = f'"<{name}>"'
        elif re.search(r"[.eE]", value):
            kind = f"<{name}:f>"
        else:
            kind = f"<{name}>"
        return match.group("key") + kind

    return sub


def _keyed(keys: str) -> re.Pattern[str]:
    return re.compile(rf'(?P<key>"(?:{keys})"\s*:\s*)(?P<value>"[^"]*"|{_NUMBER})')


_TIMESTAMP_KEYS = _keyed(
    "created|created_at|createdAt|loadedAt|loaded_at|read_at|uptime|expires_at|modified_at"
    "|resetAt|started_at|completed_at|completedAt|startedAt"
)
# Every *_ms / *Ms value is a measured time; Ollama's *_duration values are nanoseconds.
_MS_KEYS = _keyed(r"[A-Za-z0-9_]*_ms|[A-Za-z0-9]*Ms")
_NS_KEYS = _keyed(r"[a-z_]*duration")
_RATE_KEYS = _keyed(r"(?!stub_)[a-z_]*tokens_per_second")
_IDS = [
    (re.compile(r"\bresp_[0-9A-Za-z]+"), "resp_<ID>"),
    (re.compile(r"\bchatcmpl-[0-9A-Za-z]+"), "chatcmpl-<ID>"),
    (re.compile(r"\bload-\d+-[0-9a-f]+"), "load-<ID>"),
]
# NVML readings differ between machines (none here, some on a GPU box): the GPU list of
# /v1/admin/gpu-memory with its error, and the resources of /v1/capabilities.
_GPU_MEMORY = re.compile(
    r'^\{"gpus":\[(?:\{[^{}]*\},?)*\],(?P<models>"models":\[.*\]),"error":(?:null|"[^"]*"),'
)
_RESOURCES = re.compile(
    r'"resources":\{"gpuIds":\[[\d,]*\],"gpuMemoryTotalMB":\d+,"gpuMemoryUsedMB":\d+,'
    r'"gpuMemoryFreeMB":-?\d+,"gpuUtilization":(?:null|[\d.]+),'
    r'"kvCacheSizeMB":(?:null|\d+),"kvCacheUtilization":(?:null|[\d.]+),"error":(?:null|"[^"]*")\}'
)
_RESOURCES_NORMAL = (
    '"resources":{"gpuIds":<GPUS>,"gpuMemoryTotalMB":<GPU>,"gpuMemoryUsedMB":<GPU>,'
    '"gpuMemoryFreeMB":<GPU>,"gpuUtilization":<GPU>,"kvCacheSizeMB":<KV>,'
    '"kvCacheUtilization":<KV>,"error":<GPU_ERROR>}'
)

# Which GPUs a loaded model was placed on depends on the machine's GPUs too (placement
# itself is pinned in tests/actors/test_vram.py).
_PLACEMENT = re.compile(
    r'"observed_load_delta":(null|\d+),"gpus":\[(?:\[[\d,]*\],?)*\],'
    r'"gpu_split_mib":\[(?:\[[\d,]*\],?)*\]'
)

_HEADER_VALUES = {
    "content-length": "<LEN>",
    "x-request-id": "<ID>",
    "x-queue-wait-ms": "<MS>",
    "x-gpu-time-ms": "<MS>",
    "x-ratelimit-reset": "<TS>",
}
_SKIPPED_HEADERS = {"date"}


def normalize_text(text: str) -> str:
    for pattern, repl in _IDS:
        text = pattern.sub(repl, text)
    text = _TIMESTAMP_KEYS.sub(_placeholder("TS"), text)
    text = _MS_KEYS.sub(_placeholder("MS"), text)
    text = _NS_KEYS.sub(_placeholder("NS"), text)
    text = _RATE_KEYS.sub(_placeholder("RATE"), text)
    text = _GPU_MEMORY.sub(
        lambda m: '{"gpus":<GPUS>,' + m.group("models") + ',"error":<GPU_ERROR>,', text
    )
    text = _RESOURCES.sub(_RESOURCES_NORMAL, text)
    text = _PLACEMENT.sub(r'"observed_load_delta":\1,"gpus":<PLACED>', text)
    return text.replace(f'"{__version__}"', '"<VERSION>"').replace(
        f"llm-pool-{__version__}", "llm-pool-<VERSION>"
    )


def render_headers(
    headers: httpx.Headers, extra: dict[str, str] | None = None, keep: tuple[str, ...] = ()
) -> list[str]:
    """Headers sorted by name (their order on the wire is not a contract)."""
    values = {**_HEADER_VALUES, **(extra or {})}
    lines = []
    for name, value in sorted(headers.multi_items()):
        if name in _SKIPPED_HEADERS:
            continue
        lines.append(f"{name}: {value if name in keep else values.get(name, value)}")
    return lines


class Transcript:
    """The text that a case compares with its golden file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[str] = []

    def note(self, line: str) -> None:
        self.parts.append(line)

    def exchange(
        self,
        response: httpx.Response,
        *,
        headers: dict[str, str] | None = None,
        keep: tuple[str, ...] = (),
        body: Callable[[str], str] | None = None,
    ) -> None:
        """Add one HTTP exchange; the body ends at ``<EOF>`` so its last bytes are pinned."""
        request = response.request
        sent = request.content.decode()
        self.parts.append(f">>> {request.method} {normalize_text(request.url.raw_path.decode())}")
        if sent:
            self.parts.append(sent)
        raw = response.content
        if "content-length" in response.headers:
            assert int(response.headers["content-length"]) == len(raw)
        status = f"{response.http_version} {response.status_code} {response.reason_phrase}"
        self.parts.append(f"<<< {status}".rstrip())
        self.parts.extend(render_headers(response.headers, headers, keep))
        self.parts.append("")
        text = normalize_text(raw.decode())
        self.parts.append((body(text) if body else text) + "<EOF>")
        self.parts.append("")

    def check(self) -> None:
        actual = "\n".join(self.parts).rstrip("\n") + "\n"
        path = GOLDEN / f"{self.name}.txt"
        if UPDATE:
            GOLDEN.mkdir(exist_ok=True)
            path.write_text(actual, encoding="utf-8")
            return
        if not path.exists():
            pytest.fail(f"{path} is missing; run with UPDATE_GOLDEN=1 to write it")
        expected = path.read_text(encoding="utf-8")
        if actual != expected:
            diff = "".join(
                difflib.unified_diff(
                    expected.splitlines(keepends=True),
                    actual.splitlines(keepends=True),
                    f"golden/{self.name}.txt",
                    "actual",
                )
            )
            pytest.fail(f"{self.name} differs from its golden file:\n{diff}", pytrace=False)


def test_normalization_rules() -> None:
    """What the placeholders replace, and what stays pinned."""
    raw = (
        '{"id":"resp_0a1b2c","created":1712345678,"created_at":"2024-04-05T12:00:00.1Z",'
        '"loadTimeMs":12,"pool_total_wall_ms":1.5,"engine_tokenize_ms":null,'
        '"total_duration":123456,"engine_tokens_per_second":99.1,'
        '"stub_tokens_per_second":20.0,"expires_at":"2318-01-01T00:00:00Z","eval_count":6}'
    )
    assert normalize_text(raw) == (
        '{"id":"resp_<ID>","created":<TS>,"created_at":"<TS>",'
        '"loadTimeMs":<MS>,"pool_total_wall_ms":<MS:f>,"engine_tokenize_ms":null,'
        '"total_duration":<NS>,"engine_tokens_per_second":<RATE:f>,'
        '"stub_tokens_per_second":20.0,"expires_at":"2318-01-01T00:00:00Z","eval_count":6}'
    )
    assert normalize_text("chatcmpl-9f8e load-12-0badcafe") == "chatcmpl-<ID> load-<ID>"


# -- helpers ---------------------------------------------------------------------------


# The golden files were recorded by a pool with no GPU: on a GPU box the stub models
# would be placed and measured (``/api/ps`` sizes, footprints). Only the GPU cases read
# the machine's NVML (``gpus=None``), with what differs between machines normalized.
NO_GPU = FakeGpus(error="no GPU information: the golden files have none")


async def _server(
    nursery: trio.Nursery, gpus: GpuSource | None = NO_GPU, **service: Any
) -> ServerInfo:
    return await start_server(nursery, MODELS, runner_id="golden-runner", gpus=gpus, **service)


# What NVML reports on a GPU box: the cases that show GPU readings also run with this
# source in place of the machine's NVML monitor, against the same golden file.
FAKE_GPUS = FakeGpus(GpuReading(0, "NVIDIA H100 80GB HBM3", used_mib=1234, total_mib=81559))
GPU_CASES = pytest.mark.parametrize("fake_gpu", [False, True], ids=["real-gpus", "fake-gpu"])


def _client(info: ServerInfo) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=info.url, timeout=10)


async def _wait_row(
    client: httpx.AsyncClient, model: str, predicate: Callable[[dict[str, Any]], bool]
) -> None:
    """Poll a model's admin row until ``predicate`` holds (bounded)."""
    with trio.fail_after(5):
        while not predicate((await client.get(f"/v1/admin/models/{model}")).json()):
            await trio.sleep(0.01)


async def _hold(nursery: trio.Nursery, info: ServerInfo, model: str) -> trio.CancelScope:
    """Start a long stream on ``model`` in the background; cancel the scope to drop it."""
    scope = trio.CancelScope()
    body = {"model": model, "input": SLOW_REPLY, "stream": True}

    async def run() -> None:
        with scope:
            async with (
                httpx.AsyncClient(base_url=info.url, timeout=30) as client,
                client.stream("POST", "/v1/responses", json=body) as response,
            ):
                async for _ in response.aiter_bytes():
                    pass

    nursery.start_soon(run)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        await _wait_row(client, model, lambda row: row["runtime_inflight"] == 1)
    return scope


def _cases(*cases: tuple[Any, ...]) -> list[Any]:
    """Parametrize by case, named after its golden file."""
    return [pytest.param(*case, id=case[0]) for case in cases]


# -- 1. POST /v1/responses -------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "body"),
    _cases(
        ("responses_json", {"model": "paris", "input": "What is the capital of France?"}),
        (
            "responses_sse",
            {"model": "paris", "input": "What is the capital of France?", "stream": True},
        ),
        (
            "responses_messages",
            {
                "model": "echo",
                "messages": [
                    {"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "Hi, how can I help?"},
                    {"role": "user", "content": "Tell me a short story"},
                ],
            },
        ),
        (
            "responses_max_tokens",
            {"model": "paris", "input": "Capital?", "decoding": {"max_tokens": 3}},
        ),
        (
            "responses_sse_max_tokens",
            {"model": "paris", "input": "Capital?", "stream": True, "decoding": {"max_tokens": 3}},
        ),
    ),
)
async def test_responses(nursery: trio.Nursery, case: str, body: dict[str, Any]) -> None:
    info = await _server(nursery)
    transcript = Transcript(case)
    # A stream's headers leave before the generation: its X-GPU-Time-Ms is always 0.
    keep = ("x-gpu-time-ms",) if body.get("stream") else ()
    async with _client(info) as client:
        transcript.exchange(await client.post("/v1/responses", json=body), keep=keep)
    transcript.check()


async def test_responses_errors(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("responses_errors")
    async with _client(info) as client:
        for body in (
            {"model": "nope", "input": "x"},
            {"model": "paris"},
            {"model": "cold", "input": "x"},
            {"model": "cold", "input": "x", "stream": True},
        ):
            transcript.exchange(await client.post("/v1/responses", json=body))
        transcript.exchange(await client.post("/v1/responses", content=b"{not json"))
    transcript.check()


# -- 2. WebSocket /v1/responses --------------------------------------------------------

_DELTA = "response.output_text.delta"


def _ws_url(info: ServerInfo) -> str:
    return info.url.replace("http://", "ws://") + "/v1/responses"


async def _text(ws: WebSocketConnection) -> str:
    with trio.fail_after(10):
        frame = await ws.get_message()
    assert isinstance(frame, str)
    return frame


async def _frames_until(ws: WebSocketConnection, *kinds: str) -> list[str]:
    frames = []
    with trio.fail_after(10):
        while True:
            frame = await _text(ws)
            frames.append(frame)
            if json.loads(frame)["type"] in kinds:
                return frames


async def test_websocket_requests(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("websocket_requests")
    async with open_websocket_url(_ws_url(info)) as ws:
        for body in (
            {"model": "paris", "input": "What is the capital of France?"},
            {"type": "response.create", "model": "echo", "input": "second request here"},
        ):
            sent = json.dumps(body)
            await ws.send_message(sent)
            transcript.note(f">>> {sent}")
            for frame in await _frames_until(ws, "response.completed", "error"):
                transcript.note(f"<<< {normalize_text(frame)}")
    transcript.check()


async def test_websocket_errors(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("websocket_errors")
    async with open_websocket_url(_ws_url(info)) as ws:
        for sent in (
            "{not json",
            json.dumps({"model": "paris"}),
            json.dumps({"model": "nope", "input": "x"}),
            json.dumps({"model": "cold", "input": "x"}),
            json.dumps({"type": "response.cancel"}),
            json.dumps([1, 2]),
        ):
            await ws.send_message(sent)
            transcript.note(f">>> {sent}")
            transcript.note(f"<<< {normalize_text(await _text(ws))}")
    transcript.check()


_ELIDED_DELTA = re.compile(r'\{"type":"response\.output_text\.delta","delta":" w\d+"\}')


async def test_websocket_cancel(nursery: trio.Nursery) -> None:
    """How many deltas arrive before the cancel depends on timing: the frames after the
    first delta are checked against their exact shape, then elided from the transcript."""
    info = await _server(nursery)
    transcript = Transcript("websocket_cancel")
    texts: list[str] = []

    def record(frames: list[str]) -> None:
        for frame in frames:
            event = json.loads(frame)
            if event["type"] == _DELTA:
                texts.append(event["delta"])
                if len(texts) > 1:
                    assert _ELIDED_DELTA.fullmatch(frame), frame
                    continue
            transcript.note(f"<<< {normalize_text(frame)}")
            if len(texts) == 1 and event["type"] == _DELTA:
                transcript.note(f"(from here on, {_DELTA} frames of this request are elided)")

    async with open_websocket_url(_ws_url(info)) as ws:
        for sent, until in (
            ({"model": "slow", "input": "x"}, _DELTA),
            ({"model": "echo", "input": "too soon"}, "error"),
            ({"type": "response.cancel"}, "response.cancelled"),
        ):
            await ws.send_message(json.dumps(sent))
            transcript.note(f">>> {json.dumps(sent)}")
            record(await _frames_until(ws, until))
        assert SLOW_REPLY.startswith("".join(texts)) and len(texts) < 200
        after = json.dumps({"model": "paris", "input": "after the cancel"})
        await ws.send_message(after)
        transcript.note(f">>> {after}")
        for frame in await _frames_until(ws, "response.completed", "error"):
            transcript.note(f"<<< {normalize_text(frame)}")
    transcript.check()


# -- 3. POST /v1/chat/completions ------------------------------------------------------

_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize(
    ("case", "body"),
    _cases(
        ("chat_json", {"model": "paris", "messages": _CHAT}),
        ("chat_stream", {"model": "paris", "messages": _CHAT, "stream": True}),
        (
            "chat_stream_usage",
            {
                "model": "paris",
                "messages": _CHAT,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "chat_multi_turn",
            {
                "model": "echo",
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "user", "content": "Say something nice"},
                ],
            },
        ),
        ("chat_max_tokens", {"model": "paris", "messages": _CHAT, "max_tokens": 2}),
        (
            "chat_stream_max_tokens",
            {"model": "paris", "messages": _CHAT, "stream": True, "max_completion_tokens": 2},
        ),
    ),
)
@pytest.mark.parametrize("relay", ["local", "pass-through", "translated"])
async def test_chat_completions(
    nursery: trio.Nursery, case: str, body: dict[str, Any], relay: str
) -> None:
    """The same bytes from a stub model, and from an ``openai_remote`` model in front of
    a pool that serves it, on both paths of the relay (pool/backends/_pass_through.py)."""
    info = await _server(nursery)
    if relay != "local":
        remote = {
            name: {
                "backend": "openai_remote",
                "enabled": True,
                "remote_base_url": info.url + "/v1",
                "remote_model": name,
                "allow_remote": True,
            }
            for name in ("paris", "echo")
        }
        info = await start_server(
            nursery,
            remote,
            runner_id="golden-runner",
            gpus=NO_GPU,
            pass_through=relay == "pass-through",
        )
    transcript = Transcript(case)
    async with _client(info) as client:
        transcript.exchange(await client.post("/v1/chat/completions", json=body))
    transcript.check()


async def test_chat_completions_errors(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("chat_errors")
    async with _client(info) as client:
        for body in (
            {"model": "nope", "messages": _CHAT},
            {"model": "paris", "messages": "not a list"},
            {"model": "paris"},
            {"model": "cold", "messages": _CHAT},
            {"model": "cold", "messages": _CHAT, "stream": True},
            {"model": "paris", "messages": [{"role": "assistant", "content": "last"}]},
        ):
            transcript.exchange(await client.post("/v1/chat/completions", json=body))
    transcript.check()


# -- 4. Ollama -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "path", "body"),
    _cases(
        ("ollama_chat_json", "/api/chat", {"model": "paris", "messages": _CHAT, "stream": False}),
        ("ollama_chat_stream", "/api/chat", {"model": "paris", "messages": _CHAT}),
        (
            "ollama_chat_multi_turn",
            "/api/chat",
            {
                "model": "echo",
                "stream": False,
                "messages": [
                    {"role": "system", "content": "Be kind."},
                    {"role": "user", "content": "Hello there"},
                    {"role": "assistant", "content": "Hi."},
                    {"role": "user", "content": "How are you today"},
                ],
            },
        ),
        (
            "ollama_generate_json",
            "/api/generate",
            {"model": "paris", "prompt": "Capital of France?", "stream": False},
        ),
        ("ollama_generate_stream", "/api/generate", {"model": "paris", "prompt": "Capital?"}),
        (
            "ollama_generate_num_predict",
            "/api/generate",
            {
                "model": "paris",
                "prompt": "Capital?",
                "stream": False,
                "options": {"num_predict": 2},
            },
        ),
    ),
)
async def test_ollama_inference(
    nursery: trio.Nursery, case: str, path: str, body: dict[str, Any]
) -> None:
    info = await _server(nursery)
    transcript = Transcript(case)
    async with _client(info) as client:
        transcript.exchange(await client.post(path, json=body))
    transcript.check()


async def test_ollama_load_unload(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("ollama_load_unload")
    async with _client(info) as client:
        for path, body in (
            ("/api/chat", {"model": "cold", "messages": []}),
            ("/api/ps", None),
            ("/api/chat", {"model": "cold", "messages": [], "keep_alive": 0}),
            ("/api/generate", {"model": "cold"}),
            ("/api/generate", {"model": "cold", "prompt": "", "keep_alive": "0s"}),
        ):
            if body is None:
                transcript.exchange(await client.get(path))
            else:
                transcript.exchange(await client.post(path, json=body))
    transcript.check()


async def test_ollama_listings(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("ollama_listings")
    async with _client(info) as client:
        transcript.exchange(await client.get("/api/tags"))
        transcript.exchange(await client.get("/api/ps"))
        transcript.exchange(await client.post("/api/show", json={"model": "paris"}))
        transcript.exchange(await client.post("/api/show", json={"name": "cold"}))
        transcript.exchange(await client.get("/api/version"))
    transcript.check()


async def test_ollama_errors(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("ollama_errors")
    async with _client(info) as client:
        for path, body in (
            ("/api/chat", {"model": "nope", "messages": _CHAT}),
            ("/api/generate", {"model": "nope", "prompt": "x"}),
            ("/api/chat", {"model": "cold", "messages": _CHAT, "stream": False}),
            ("/api/chat", {"model": "cold", "messages": _CHAT}),
            ("/api/chat", {"messages": _CHAT}),
            ("/api/show", {"model": "nope"}),
        ):
            transcript.exchange(await client.post(path, json=body))
    transcript.check()


# -- 5. Runner API ---------------------------------------------------------------------


@GPU_CASES
async def test_runner_capabilities_and_health(nursery: trio.Nursery, fake_gpu: bool) -> None:
    info = await _server(nursery, gpus=FAKE_GPUS if fake_gpu else None)
    transcript = Transcript("runner_capabilities")
    async with _client(info) as client:
        transcript.exchange(await client.get("/v1/capabilities"))
        transcript.exchange(await client.get("/health"))
    transcript.check()


async def _poll_task(client: httpx.AsyncClient, task_id: str) -> httpx.Response:
    with trio.fail_after(5):
        while True:
            reply = await client.get(f"/v1/models/load/{task_id}")
            if reply.json()["status"] != "loading":
                return reply
            await trio.sleep(0.01)


async def test_runner_load_tasks(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("runner_load_tasks")
    async with _client(info) as client:
        for body in ({"modelId": "cold"}, {"modelId": "broken", "evictModel": "echo"}):
            started = await client.post("/v1/models/load", json=body)
            transcript.exchange(started)
            transcript.exchange(await _poll_task(client, started.json()["taskId"]))
        transcript.exchange(await client.get("/v1/models/load/load-0-00000000"))
        for invalid in (
            {"modelId": "nope"},
            {"modelId": "cold", "quantization": "awq-4bit"},
            {"modelId": "cold", "maxContextLength": 4096},
            {"modelId": "cold", "evictModel": "cold"},
            {},
        ):
            transcript.exchange(await client.post("/v1/models/load", json=invalid))
        transcript.exchange(await client.post("/v1/models/unload", json={"modelId": "cold"}))
        transcript.exchange(await client.post("/v1/models/unload", json={"modelId": "cold"}))
        transcript.exchange(await client.post("/v1/models/unload", json={"modelId": "nope"}))
    transcript.check()


async def test_runner_cache_flush(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("runner_cache_flush")
    async with _client(info) as client:
        for body in (
            {"scope": "all"},
            {"scope": "model", "modelId": "paris"},
            {"scope": "model"},
            {"scope": "tenant"},
            {"scope": "tag"},
            {"scope": "planet"},
        ):
            transcript.exchange(await client.post("/v1/cache/flush", json=body))
    transcript.check()


async def test_health_every_model_failed(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, {"broken": MODELS["broken"] | {"enabled": True}}, gpus=NO_GPU
    )
    transcript = Transcript("health_unhealthy")
    async with _client(info) as client:
        transcript.exchange(await client.get("/health"))
    transcript.check()


_SAMPLE = re.compile(r"^(?P<series>[^#\s][^ ]*) (?P<value>\S+)$", re.MULTILINE)
# Series whose values are timings or clock readings; counts and states stay pinned.
_TIMED_SERIES = re.compile(r"_(bucket|sum|created)\b")


def _metrics_body(text: str) -> str:
    def sub(match: re.Match[str]) -> str:
        series = match.group("series")
        if series.startswith("llm_pool_gpu_memory_"):
            return "<GPU>"
        if series in ("llm_pool_trio_tasks", "llm_pool_threads"):
            return f"{series} <V>"  # live counts of this process
        if series == "llm_pool_usage_records_written_total":
            return f"{series} <V>"  # the usage writer flushes on its own timer
        if _TIMED_SERIES.search(series) and 'le="+Inf"' not in series:
            return f"{series} <V>"
        return match.group(0)

    lines = [line for line in _SAMPLE.sub(sub, text).splitlines() if line != "<GPU>"]
    # Series appear in the order they were first observed, and the startup loads run
    # concurrently: sort each family's samples by their labels (bucket order kept).
    out: list[str] = []
    samples: list[str] = []
    for line in [*lines, "#"]:
        if line.startswith("#"):
            out.extend(sorted(samples, key=_labels))
            samples = []
            out.append(line)
        else:
            samples.append(line)
    return "\n".join(out[:-1]) + ("\n" if text.endswith("\n") else "")


def _labels(sample: str) -> str:
    labels = sample.partition("{")[2].partition("}")[0]
    return re.sub(r'le="[^"]*",?', "", labels)


@GPU_CASES
async def test_metrics(nursery: trio.Nursery, fake_gpu: bool) -> None:
    info = await _server(nursery, gpus=FAKE_GPUS if fake_gpu else None)
    transcript = Transcript("metrics")
    async with _client(info) as client:
        body = {"model": "paris", "input": "x"}
        await client.post("/v1/responses", json=body, headers={"X-Tenant-ID": "t1"})
        await client.post("/v1/responses", json=body | {"stream": True})
        await client.post("/v1/responses", json={"model": "cold", "input": "x"})
        await client.post("/v1/admin/models/cold/load")
        await client.post("/v1/admin/models/cold/unload")
        await client.post("/v1/admin/models/broken/load")
        transcript.exchange(await client.get("/metrics"), body=_metrics_body)
    transcript.check()


# -- 6. Admin --------------------------------------------------------------------------


@GPU_CASES
async def test_admin_listings(nursery: trio.Nursery, fake_gpu: bool) -> None:
    info = await _server(nursery, gpus=FAKE_GPUS if fake_gpu else None)
    transcript = Transcript("admin_listings")
    async with _client(info) as client:
        transcript.exchange(await client.get("/v1/models"))
        transcript.exchange(await client.get("/v1/admin/models"))
        transcript.exchange(await client.get("/v1/admin/models/paris"))
        transcript.exchange(await client.get("/v1/admin/models/nope"))
        transcript.exchange(await client.get("/v1/admin/gpu-memory"))
    transcript.check()


async def test_admin_load_unload(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("admin_load_unload")
    async with _client(info) as client:
        for path, body in (
            ("/v1/admin/models/cold/load", {"gguf_n_ctx": 4096}),
            ("/v1/admin/models/cold/load", {"gguf_n_ctx": 0}),
            ("/v1/admin/models/cold/load", {"replicas": 0}),
            ("/v1/admin/models/cold/load", {"bogus": 1}),
            ("/v1/admin/models/cold/load", None),
            ("/v1/admin/models/cold/load", {}),
            ("/v1/admin/models/cold/load", {"replicas": 2}),
            ("/v1/admin/models/nope/load", None),
        ):
            transcript.exchange(await client.post(path, json=body))
        transcript.exchange(await client.get("/v1/models"))
        transcript.exchange(await client.get("/v1/admin/gpu-memory"))
        transcript.exchange(await client.post("/v1/admin/models/cold/unload"))
        transcript.exchange(await client.post("/v1/admin/models/cold/unload"))
    transcript.check()


async def test_admin_load_failed(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("admin_load_failed")
    async with _client(info) as client:
        transcript.exchange(await client.post("/v1/admin/models/broken/load"))
        transcript.exchange(await client.get("/v1/admin/models/broken"))
        transcript.exchange(
            await client.post("/v1/responses", json={"model": "broken", "input": "x"})
        )
    transcript.check()


# -- 7. Errors: queue_full and rate limits --------------------------------------------


async def test_queue_full(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("queue_full")
    holder = await _hold(nursery, info, "slow")
    async with _client(info) as client:
        body = {"model": "slow", "input": "x"}
        transcript.exchange(await client.post("/v1/responses", json=body))
        transcript.exchange(await client.post("/v1/responses", json=body | {"stream": True}))
        transcript.exchange(
            await client.post("/v1/chat/completions", json={"model": "slow", "messages": _CHAT})
        )
        transcript.exchange(
            await client.post("/api/chat", json={"model": "slow", "messages": _CHAT})
        )
        async with open_websocket_url(_ws_url(info)) as ws:
            sent = json.dumps(body)
            await ws.send_message(sent)
            transcript.note(f">>> WS {sent}")
            for frame in await _frames_until(ws, "error", "response.completed"):
                transcript.note(f"<<< {normalize_text(frame)}")
    holder.cancel()
    transcript.check()


async def test_rate_limit(nursery: trio.Nursery) -> None:
    info = await _server(
        nursery, tenancy={"tenants": {"metered": {"requests_per_minute": 2, "burst": 2}}}
    )
    transcript = Transcript("rate_limit")
    metered = {"X-Tenant-ID": "metered"}
    body = {"model": "paris", "input": "x"}
    async with _client(info) as client:
        for _ in range(2):
            transcript.exchange(await client.post("/v1/responses", json=body, headers=metered))
        refused = await client.post("/v1/responses", json=body, headers=metered)
        # The wait is what is left of the refill period: a clock reading.
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        transcript.exchange(refused, headers={"retry-after": "<S>"})
        chat = await client.post(
            "/v1/chat/completions", json={"model": "paris", "messages": _CHAT}, headers=metered
        )
        transcript.exchange(chat, headers={"retry-after": "<S>"})
        ollama = await client.post(
            "/api/chat", json={"model": "paris", "messages": _CHAT}, headers=metered
        )
        transcript.exchange(ollama, headers={"retry-after": "<S>"})
    transcript.check()


async def test_queue_timeout(nursery: trio.Nursery) -> None:
    info = await _server(nursery)
    transcript = Transcript("queue_timeout")
    holder = await _hold(nursery, info, "gate")
    async with _client(info) as client:
        body = {"model": "gate", "input": "x"}
        transcript.exchange(await client.post("/v1/responses", json=body))
        transcript.exchange(await client.post("/v1/responses", json=body | {"stream": True}))
        transcript.exchange(
            await client.post("/v1/chat/completions", json={"model": "gate", "messages": _CHAT})
        )
        transcript.exchange(
            await client.post("/api/generate", json={"model": "gate", "prompt": "x"})
        )
    holder.cancel()
    transcript.check()


# -- Routing and auth errors -----------------------------------------------------------


async def test_http_errors(nursery: trio.Nursery) -> None:
    info = await _server(nursery, max_body_bytes=100)
    transcript = Transcript("http_errors")
    async with _client(info) as client:
        transcript.exchange(await client.get("/v1/nope"))
        transcript.exchange(await client.get("/v1/responses"))
        transcript.exchange(await client.delete("/v1/admin/models"))
        transcript.exchange(
            await client.post("/v1/responses", json={"model": "paris", "input": "x" * 100})
        )
        transcript.exchange(
            await client.post(
                "/v1/responses",
                json={"model": "paris", "input": "x"},
                headers={"X-Priority": "urgent"},
            )
        )
    transcript.check()


async def test_unauthorized(nursery: trio.Nursery) -> None:
    info = await _server(nursery, auth={"inference_tokens": ["user"], "admin_token": "root"})
    transcript = Transcript("unauthorized")
    user = {"Authorization": "Bearer user"}
    async with _client(info) as client:
        transcript.exchange(
            await client.post("/v1/responses", json={"model": "paris", "input": "x"})
        )
        transcript.exchange(
            await client.post("/v1/chat/completions", json={"model": "paris", "messages": _CHAT})
        )
        transcript.exchange(
            await client.post("/api/chat", json={"model": "paris", "messages": _CHAT})
        )
        transcript.exchange(await client.get("/v1/admin/models", headers=user))
        transcript.exchange(
            await client.post("/v1/models/unload", json={"modelId": "paris"}, headers=user)
        )
        transcript.exchange(await client.get("/metrics", headers=user))
    async with open_websocket_url(_ws_url(info)) as ws:
        transcript.note("<<< WS " + normalize_text(await _text(ws)))
        with trio.fail_after(5), pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        reason = closed.value.reason
        assert reason is not None
        transcript.note(f"<<< WS close {reason.code} {reason.name} {reason.reason!r}")
    transcript.check()
