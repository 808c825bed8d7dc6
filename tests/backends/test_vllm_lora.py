"""LoRA adapters on vLLM, in-process and as ``vllm serve``: what the pool hands vLLM
(engine arguments, flags, the request's LoRARequest or model name, the runtime
load/unload calls), checked without vLLM; vLLM's own serving is tested in its env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError
from pool.backends import AdapterUse, Decoding, GenerationRequest, TextPart, Turn
from pool.backends._vllm_fields import engine_arguments
from pool.backends.vllm import VllmBackend, VllmModel
from pool.backends.vllm_serve import VllmServeBackend, VllmServeModel, command_line
from pool.config import build_settings


def _definition(backend: str, **fields: Any) -> Any:
    settings = build_settings(
        {"engine": {"models": {"v": {"backend": backend, "vllm_model": "/m", **fields}}}}
    )
    return settings.engine.models["v"]


def _request(adapter: str | None) -> GenerationRequest:
    return GenerationRequest(
        "r",
        adapter or "v",
        (Turn("user", (TextPart("hi"),)),),
        Decoding(),
        adapter=None if adapter is None else AdapterUse(adapter),
    )


def test_adapters_turn_lora_on_in_the_engine_arguments(tmp_path: Path) -> None:
    plain = _definition("vllm")
    assert "enable_lora" not in engine_arguments(plain)
    tuned = _definition(
        "vllm",
        lora_adapters=[{"name": "t1", "path": str(tmp_path)}],
        vllm_max_loras=4,
        vllm_max_lora_rank=16,
    )
    arguments = engine_arguments(tuned)
    assert arguments["enable_lora"] is True
    assert (arguments["max_loras"], arguments["max_lora_rank"]) == (4, 16)
    assert engine_arguments(_definition("vllm", vllm_enable_lora=True))["enable_lora"] is True


def test_vllm_serve_serves_each_adapter_under_its_name(tmp_path: Path) -> None:
    d = _definition(
        "vllm_serve",
        lora_adapters=[
            {"name": "t1", "path": str(tmp_path / "a")},
            {"name": "t2", "path": "b"},
        ],
    )
    assert isinstance(d, VllmServeModel)
    args = command_line(d, "vllm", "/m", 9000, "v", base_dir="/adapters")
    assert "--enable-lora" in args
    at = args.index("--lora-modules")
    assert args[at + 1 : at + 3] == [f"t1={tmp_path / 'a'}", "t2=/adapters/b"]
    assert "--lora-modules" not in command_line(_definition("vllm_serve"), "vllm", "/m", 1, "v")


def test_vllm_serve_names_the_adapter_as_the_model() -> None:
    from pool.backends._managed import ManagedServerRuntime
    from pool.backends.vllm_serve import _adapter_model

    runtime = ManagedServerRuntime.__new__(ManagedServerRuntime)
    runtime._model = "v"
    runtime._extra = {}
    runtime._repetition_field = "repetition_penalty"
    runtime._enable_thinking = None
    runtime._adapter_fields = _adapter_model
    assert runtime.body(_request("t1"))["model"] == "t1"
    assert runtime.body(_request(None))["model"] == "v"


@pytest.mark.parametrize("backend", [VllmBackend(), VllmServeBackend()])
def test_vllm_refuses_a_scale_and_a_runtime_add_without_lora(backend: Any) -> None:
    name = backend.name
    scaled = _definition(name, lora_adapters=[{"name": "t", "path": "/a", "scale": 0.5}])
    with pytest.raises(PoolError) as refused:
        backend.check_adapters(scaled)
    assert refused.value.code == "invalid_load_request" and "scale" in refused.value.message
    backend.check_adapters(_definition(name, lora_adapters=[{"name": "t", "path": "/a"}]))
    with pytest.raises(PoolError) as late:
        backend.check_adapters(_definition(name), at_runtime=True)
    assert "vllm_enable_lora" in late.value.message
    backend.check_adapters(_definition(name, vllm_enable_lora=True), at_runtime=True)


async def test_in_process_jobs_carry_their_lora_request(tmp_path: Path) -> None:
    from pool.backends._vllm_engine import EngineHost
    from pool.backends.prompt_formats import get_prompt_format
    from pool.backends.vllm import VllmRuntime

    definition = _definition(
        "vllm", prompt_format="qwen3_template", lora_adapters=[{"name": "t1", "path": "/a"}]
    )
    assert isinstance(definition, VllmModel)
    runtime = VllmRuntime(
        EngineHost("vllm-test"),
        definition,
        get_prompt_format("qwen3_template"),
        trio.CapacityLimiter(1),
        0.0,
        adapters={"t1": tmp_path / "t1"},
    )
    job = runtime.engine_job(_request("t1"), runtime.render(_request("t1")))
    assert job.lora == ("t1", 1, str(tmp_path / "t1"))
    assert runtime.engine_job(_request(None), runtime.render(_request(None))).lora is None
    with pytest.raises(PoolError) as unknown:
        runtime.engine_job(_request("t9"), runtime.render(_request("t9")))
    assert unknown.value.code == "unknown_model"


async def test_vllm_serve_loads_and_unloads_adapters_at_runtime(nursery: trio.Nursery) -> None:
    """The calls vLLM's server answers with VLLM_ALLOW_RUNTIME_LORA_UPDATING, made to a
    recording HTTP server; a refusal of the server's is the pool's BackendError."""
    import json
    import types
    from functools import partial

    from pool.backends._managed import ManagedServerRuntime
    from pool.backends._upstream import open_transport
    from pool.errors import BackendError

    calls: list[tuple[str, dict[str, Any]]] = []

    async def handle(stream: trio.SocketStream) -> None:
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some()
                if not data:
                    return
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = next(
                int(line.split(":")[1])
                for line in lines
                if line.lower().startswith("content-length")
            )
            while len(buffer) < length:
                buffer += await stream.receive_some()
            body, buffer = buffer[:length], buffer[length:]
            calls.append((lines[0].split()[1], json.loads(body)))
            status = "400 Bad Request" if b"bad" in body else "200 OK"
            answer = b'{"ok": true}'
            await stream.send_all(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(answer)}\r\n\r\n".encode()
                + answer
            )

    listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    runtime = ManagedServerRuntime.__new__(ManagedServerRuntime)
    runtime.process = types.SimpleNamespace(label="vllm[0]")  # type: ignore[assignment]
    runtime._headers = None
    runtime._runtime_adapters = True
    runtime._upstream = open_transport(f"http://127.0.0.1:{port}", timeout_s=10.0)
    await runtime.add_adapter("t1", Path("/adapters/t1"), 1.0)
    await runtime.remove_adapter("t1")
    assert calls == [
        ("/v1/load_lora_adapter", {"lora_name": "t1", "lora_path": "/adapters/t1"}),
        ("/v1/unload_lora_adapter", {"lora_name": "t1"}),
    ]
    with pytest.raises(BackendError, match="HTTP 400"):
        await runtime.add_adapter("bad", Path("/bad"), 1.0)
    runtime._runtime_adapters = False
    with pytest.raises(BackendError, match="takes no LoRA adapter"):
        await runtime.add_adapter("t2", Path("/adapters/t2"), 1.0)
    await runtime._upstream.aclose()
