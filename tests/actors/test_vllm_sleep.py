"""vLLM's sleep mode as the pool uses it: an eviction of an in-process ``vllm`` model on a
GPU puts its engine to sleep (level 1) where the host has the RAM, the gate counts its
GPU memory as free, and its next load wakes the same engine instead of starting one.

vLLM is faked at the backend's boundary (``tests/backends/fake_vllm.py``, vLLM 0.32's
signatures, held to the source of the vLLM that scripts/build-vllm-env installs by
``tests/backends/vllm_contract.py``); the pool, the gate, the engine host's thread and
loop are the real ones. A real GPU runs the same through ``scripts/gpu-check vllm-sleep``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pool import open_pool
from pool.actors.residency import _residency
from pool.actors.residency._sleep import HostRam
from pool.config import build_settings
from tests.backends import fake_vllm, vllm_contract
from tests.backends.fake_vllm import CONTEXT_MIB, KV_CACHE_MIB, WEIGHTS_MIB, FakeGpu
from tests.components import in_ci, missing

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ENV = "LLM_POOL_VLLM_SOURCE"

PLENTY = HostRam(available_mib=64_000, total_mib=128_000)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path


def weights_folder(tmp_path: Path, name: str, mib: int = 1200) -> str:
    folder = tmp_path / name
    folder.mkdir()
    with (folder / "model.safetensors").open("wb") as out:
        out.truncate(mib * 1024 * 1024)  # sparse: the size is what counts
    (folder / "config.json").write_text("{}")
    return str(folder)


def settings(tmp_path: Path, **fields: Any) -> Any:
    model = {"backend": "vllm", "vram_mb": WEIGHTS_MIB + KV_CACHE_MIB, **fields}
    return build_settings(
        {
            "engine": {
                "gpu_budget_mib": [6000],
                "gpu_reserve_mib": 0,
                "min_resident_s": 0,
                "models": {
                    "a": {**model, "model_path": weights_folder(tmp_path, "a")},
                    "b": {**model, "model_path": weights_folder(tmp_path, "b")},
                },
            }
        }
    )


def host_ram(monkeypatch: pytest.MonkeyPatch, ram: HostRam | None) -> None:
    monkeypatch.setattr(_residency, "read_host_ram", lambda: ram)


async def test_an_eviction_sleeps_and_the_next_load_wakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGpu(total_mib=8192)
    engines = fake_vllm.install(monkeypatch, gpu)
    host_ram(monkeypatch, PLENTY)
    async with open_pool(settings(tmp_path), gpus=gpu) as pool:
        await pool.load("a")
        (engine_a,) = engines.engines
        assert engine_a.vllm_config.model_config.enable_sleep_mode is True
        await pool.load("b")  # a does not fit beside it: a sleeps
        row = pool.snapshot("a")
        assert (row.state, row.unload_reason) == ("unloaded", "evicted")
        assert row.asleep_ram_mib == 1200  # its weights' files
        assert engine_a.calls == ["sleep(1)"] and not engine_a.shut_down
        # Its GPU memory is free (only its CUDA context stays), and the gate counts none.
        assert gpu.held[id(engine_a)] == CONTEXT_MIB
        assert "a" not in pool.parts_for_tests().residency.lease_holdings()
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert evict.model == "a" and evict.details["sleep"] is True
        assert "sleeps (vLLM sleep mode, level 1): 1200 MiB of weights" in evict.reason

        await pool.load("a")  # b sleeps in turn; a wakes: no new engine for it
        assert len(engines.engines) == 2
        assert engine_a.calls == ["sleep(1)", "wake_up"]
        row = pool.snapshot("a")
        assert (row.state, row.asleep_ram_mib, row.unload_reason) == ("loaded", None, None)
        assert pool.model("a").wake_count == 1
        assert pool.snapshot("b").asleep_ram_mib == 1200

        # An operator's unload of a sleeping model closes its engine for good.
        engine_b = engines.engines[1]
        await pool.unload("b")
        assert engine_b.shut_down and id(engine_b) not in gpu.held
        assert pool.snapshot("b").asleep_ram_mib is None
        assert pool.snapshot("b").unload_reason == "requested"
    assert engine_a.shut_down  # the pool's shutdown closes the rest


async def test_short_host_ram_unloads_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGpu(total_mib=8192)
    engines = fake_vllm.install(monkeypatch, gpu)
    # 1200 MiB of weights would leave less than the 2048 MiB margin free.
    host_ram(monkeypatch, HostRam(available_mib=3000, total_mib=16_000))
    async with open_pool(settings(tmp_path), gpus=gpu) as pool:
        await pool.load("a")
        await pool.load("b")
        engine_a = engines.engines[0]
        assert engine_a.calls == ["shutdown"]
        assert pool.snapshot("a").asleep_ram_mib is None
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert evict.details["sleep"] is False
        assert "unloads: host RAM is short for a sleep (1200 MiB of weights" in evict.reason
        await pool.load("a")
        assert len(engines.engines) == 3  # loaded anew


async def test_a_load_that_differs_from_the_sleeper_starts_a_new_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = FakeGpu(total_mib=8192)
    engines = fake_vllm.install(monkeypatch, gpu)
    host_ram(monkeypatch, PLENTY)
    async with open_pool(settings(tmp_path), gpus=gpu) as pool:
        await pool.load("a")
        await pool.load("b")
        engine_a = engines.engines[0]
        await pool.unload("b")
        await pool.load("a", {"vllm_max_model_len": 512})
        assert engine_a.calls == ["sleep(1)", "shutdown"]
        assert len(engines.engines) == 3
        assert engines.engines[2].vllm_config.arguments["max_model_len"] == 512


async def test_off_a_gpu_or_switched_off_the_engine_never_sleeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sleep mode is CUDA's: on virtual GPUs (and with ``vllm_sleep_mode: false``) the
    engine starts without it and an eviction unloads."""
    gpu = FakeGpu(total_mib=8192)
    engines = fake_vllm.install(monkeypatch, gpu)
    host_ram(monkeypatch, PLENTY)
    async with open_pool(settings(tmp_path, vllm_sleep_mode=False), gpus=gpu) as pool:
        await pool.load("a")
        await pool.load("b")
        assert engines.engines[0].calls == ["shutdown"]
        assert engines.engines[0].vllm_config.model_config.enable_sleep_mode is False
    (tmp_path / "v").mkdir()
    async with open_pool(settings(tmp_path / "v")) as pool:  # virtual GPUs: no device
        await pool.load("a")
        assert engines.engines[-1].vllm_config.model_config.enable_sleep_mode is False
        assert pool.residence("a").sleep_ram_mib() is None  # an eviction would unload it


def test_weights_size_of_a_folder(tmp_path: Path) -> None:
    from pool.backends.vllm import weights_mib

    assert weights_mib(weights_folder(tmp_path, "w", 300)) == 300
    assert weights_mib("org/model-on-the-hub") is None


# -- the fake held to vLLM ---------------------------------------------------------------


@pytest.fixture
def vllm_source() -> Path:
    """The ``vllm`` package source the fake is held to: ``$LLM_POOL_VLLM_SOURCE`` (a
    folder of it, such as an unpacked wheel, to check another release), else that of the
    environment scripts/build-vllm-env builds. Under CI that environment is built when
    it is not yet (the real-engine tests use the same one, cached); elsewhere its absence
    skips the test rather than spend minutes and 3.5 GB on it (tests/components.py)."""
    configured = os.environ.get(SOURCE_ENV)
    if configured:
        root = Path(configured)
        if not (root / "__init__.py").is_file() and (root / "vllm/__init__.py").is_file():
            root = root / "vllm"
        if not (root / "__init__.py").is_file():
            pytest.fail(f"{SOURCE_ENV}={configured} holds no vllm package source")
        return root
    script = ["bash", str(ROOT / "scripts" / "build-vllm-env")]
    built = subprocess.run(
        script if in_ci() else [*script, "--if-built"], capture_output=True, text=True
    )
    if built.returncode != 0:
        missing("vLLM's environment", built.stderr.strip()[-2000:])
    # find_spec of a top-level package finds it without importing it (nor torch).
    where = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    found = subprocess.run(
        [built.stdout.strip(), "-c", where], capture_output=True, text=True, check=True
    )
    return Path(found.stdout.strip())


@pytest.mark.timeout(1800)  # under CI, scripts/build-vllm-env first: minutes when not cached
def test_the_fake_follows_vllms_source(vllm_source: Path) -> None:
    """``sleep``, ``wake_up`` and ``is_sleeping`` of the fake take and return what
    vLLM's ``AsyncLLM`` does, its other methods take the same parameters, and
    ``enable_sleep_mode`` is an engine argument with the fake's default that reaches
    ``ModelConfig`` (tests/backends/vllm_contract.py says how)."""
    problems = vllm_contract.problems(vllm_source)
    assert not problems, f"vLLM at {vllm_source}:\n" + "\n".join(problems)


@pytest.mark.timeout(1800)
def test_the_check_finds_a_fake_that_drifted(
    vllm_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def wake_up(self: Any, tag: str | None = None) -> None:
        return None

    def is_sleeping(self: Any) -> bool:
        return False

    def engine_args(self: Any, model: str, *, enable_sleep_mode: bool = True) -> None:
        return None

    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "wake_up", wake_up)
    monkeypatch.setattr(fake_vllm.FakeAsyncLLM, "is_sleeping", is_sleeping)
    monkeypatch.setattr(fake_vllm.EngineArgs, "__init__", engine_args)
    problems = "\n".join(vllm_contract.problems(vllm_source))
    assert "AsyncLLM.wake_up: parameters (tags positional_or_keyword)" in problems, problems
    assert "AsyncLLM.wake_up: returns bool in vLLM, None in the fake" in problems, problems
    assert "AsyncLLM.is_sleeping: vLLM's is a coroutine, the fake's is not" in problems
    assert "EngineArgs.enable_sleep_mode defaults to False" in problems, problems


@pytest.mark.timeout(1800)
async def test_the_resume_bodies_are_vllms_request_fields(
    vllm_source: Path, tmp_path: Path
) -> None:
    """Every field of the bodies a ``vllm_serve`` resume sends (its two /tokenize calls
    and /v1/completions, as the fake server logged them) is one vLLM's request classes
    declare; and a misspelt one is found."""
    from tests.backends.test_vllm_serve import paused_and_resumed, sent_bodies

    _, logged = await paused_and_resumed(tmp_path)
    classes = {
        ("tokenize", True): "TokenizeChatRequest",
        ("tokenize", False): "TokenizeCompletionRequest",
        ("completions", False): "CompletionRequest",
    }
    sent: dict[str, set[str]] = {}
    for route, body in sent_bodies(logged):
        sent.setdefault(classes[route, "messages" in body], set()).update(body)
    # The completions body carries stream and stream_options too (stream_chat adds them).
    assert set(sent) == set(classes.values()) and "prompt" in sent["CompletionRequest"]
    problems = vllm_contract.request_field_problems(vllm_source, sent)
    assert not problems, f"vLLM at {vllm_source}:\n" + "\n".join(problems)
    sent["CompletionRequest"].add("prompt_ids")
    drifted = vllm_contract.request_field_problems(vllm_source, sent)
    assert drifted == [
        "CompletionRequest.prompt_ids: the pool sends it; vLLM does not declare it"
    ], drifted
