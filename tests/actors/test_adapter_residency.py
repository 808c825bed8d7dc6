"""LoRA adapters in the residency owner's accounting, with the stub (its adapters are
files whose sizes it reports as VRAM): counted on their base's GPUs, evicted alone (least
recently used first, with their decision) before the base is considered, back with their
next request, and previewed (``dry_run``) before one is added."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pool import PoolError, open_pool, request_from_responses
from pool.config import build_settings

MIB = 1024 * 1024


def _file(folder: Path, name: str, mib: float = 1.5) -> str:
    path = folder / f"{name}.gguf"
    path.write_bytes(b"\0" * int(mib * MIB))
    return str(path)


def _settings(tmp_path: Path) -> Any:
    """A virtual GPU of 500 MiB: the base (300 MiB) and two adapters (1.5 MiB each, 3
    MiB together) leave 197 MiB, one short of the other model's 198."""
    adapters = [
        {"name": "base-old", "path": _file(tmp_path, "old")},
        {"name": "base-new", "path": _file(tmp_path, "new")},
    ]
    return build_settings(
        {
            "engine": {
                "gpu_budget_mib": [500],
                "gpu_reserve_mib": 0,
                "min_resident_s": 0,
                "models": {
                    "base": {
                        "backend": "stub",
                        "enabled": True,
                        "stub_vram_mib": 300,
                        "lora_adapters": adapters,
                    },
                    "other": {"backend": "stub", "stub_vram_mib": 198},
                },
            }
        }
    )


async def _answer(pool: Any, model: str) -> str:
    reply = await pool.respond(request_from_responses({"model": model, "input": "hello there"}))
    return str(reply.text)


async def test_adapters_count_on_their_base_and_one_is_evicted_alone(tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        assert await _answer(pool, "base-old") == "[base-old] hello there"
        assert await _answer(pool, "base-new") == "[base-new] hello there"
        assert await _answer(pool, "base") == "hello there"
        assert pool.snapshot("base").vram.mib == 303
        await pool.load("other")
        row = pool.snapshot("base")
        assert row.state == "loaded"
        assert {a.name: a.evicted for a in row.adapters} == {"base-old": True, "base-new": False}
        assert row.vram.mib == 301
        evictions = [d for d in pool.decisions() if d.action == "evict"]
        assert [(d.model, d.for_model) for d in evictions] == [("base-old", "other")]
        assert "evicted alone" in evictions[0].reason
        # It is still served: its next request loads it again.
        assert await _answer(pool, "base-old") == "[base-old] hello there"
        assert not pool.snapshot("base").adapters[0].evicted


async def test_the_base_goes_once_its_adapters_are_not_enough(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    settings.engine.models["other"].stub_vram_mib = 250  # type: ignore[attr-defined]
    async with open_pool(settings) as pool:
        await pool.load("other")
        evicted = [d.model for d in pool.decisions() if d.action == "evict"]
        # Oldest decisions last: both adapters alone first (never used: either order),
        # then the base.
        assert evicted[0] == "base" and set(evicted[1:]) == {"base-old", "base-new"}
        assert pool.snapshot("base").state == "unloaded"
        # Unloaded with its base, back with it.
        await pool.unload("other")
        await pool.load("base")
        assert await _answer(pool, "base-new") == "[base-new] hello there"
        assert not any(a.evicted for a in pool.snapshot("base").adapters)


async def test_the_preview_says_whether_an_adapter_fits(tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        small = {"name": "base-small", "path": _file(tmp_path, "small", 50)}
        preview = pool.preview_adapter("base", small)
        assert preview["fits"] is True and preview["need_mib"] == 50
        assert preview["gpus"] == [[0]] and preview["gpu_split_mib"] == [[50]]
        large = {"name": "base-large", "path": _file(tmp_path, "large", 250)}
        refused = pool.preview_adapter("base", large)
        assert refused["fits"] is False and refused["error"] == "load_failed"
        assert pool.snapshot("base").adapters[-1].name == "base-new"  # nothing changed
        with pytest.raises(PoolError) as no_room:
            await pool.add_adapter("base", large)
        assert no_room.value.code == "load_failed"
        row = await pool.add_adapter("base", small)
        assert row.vram.mib == 353
        missing = pool.preview_adapter("base", {"name": "x", "path": str(tmp_path / "none")})
        assert missing["error"] == "invalid_request" and missing["fits"] is False
