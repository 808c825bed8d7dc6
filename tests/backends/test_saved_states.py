"""Saved prompt states on disk: written at close, read back once, bounded, never
another model's, and a damaged file ignored with a log line."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import pytest

from pool.backends._prefix_cache import SavedState, scope_matches
from pool.backends._saved_states import (
    PARTIAL,
    STALE_PARTIAL_S,
    SUFFIX,
    DiskStates,
    model_key,
)


def _state(key: tuple[str, str | None], tokens: list[int], payload: bytes) -> SavedState:
    buffer = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
    return SavedState(key, tuple(tokens), buffer, len(payload))


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{SUFFIX}"))


def test_written_states_come_back_once_for_their_model_only(tmp_path: Path) -> None:
    before = DiskStates(tmp_path, "model-a", 1 << 20)
    assert (
        before.write(
            [_state(("t1", None), [1, 2, 3, 4], b"AAAA" * 100), _state(("t2", "x"), [1, 2], b"B")]
        )
        == 2
    )
    after = DiskStates(tmp_path, "model-a", 1 << 20)
    after.index()
    entry, shared = after.best(("t1", None), [1, 2, 3, 9])
    assert entry is not None and shared == 3
    assert after.best(("t3", None), [1, 2, 3, 4]) == (None, 0)  # another scope
    restored = after.take(entry)
    assert restored is not None and restored.tokens == (1, 2, 3, 4)
    assert bytes(restored.state) == b"AAAA" * 100 and restored.key == ("t1", None)
    assert len(_files(tmp_path)) == 1  # taken: its file is gone
    other = DiskStates(tmp_path, "model-b", 1 << 20)
    other.index()
    assert other.entries == []  # another model's (or other settings') states are not read


def test_a_damaged_or_truncated_file_is_ignored_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pool.backends")
    DiskStates(tmp_path, "m", 1 << 20).write(
        [_state(("t", None), [5, 6, 7], b"good state"), _state(("u", None), [8, 9], b"x" * 50)]
    )
    first, second = _files(tmp_path)
    # One file's state flipped (its digest no longer matches); one cut short in its tokens.
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    second.write_bytes(second.read_bytes()[:40])
    disk = DiskStates(tmp_path, "m", 1 << 20)
    disk.index()
    assert len(disk.entries) == 1  # the truncated one is dropped at once
    assert disk.take(disk.entries[0]) is None  # the damaged one is refused when read
    assert _files(tmp_path) == []
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "ignored" in logged and "damaged" in logged


def test_the_folder_stays_within_its_bound_oldest_first_across_models(tmp_path: Path) -> None:
    for age, name in enumerate(("old", "mid", "new")):
        DiskStates(tmp_path, name, 10_000).write([_state(("t", None), [age], b"z" * 3000)])
        (path,) = [p for p in _files(tmp_path) if p.name.startswith(name)]
        os.utime(path, ns=(age * 10**9, age * 10**9))
    sizes = sum(p.stat().st_size for p in _files(tmp_path))
    assert sizes <= 10_000
    DiskStates(tmp_path, "newest", 10_000).write([_state(("t", None), [9], b"z" * 3000)])
    assert sum(p.stat().st_size for p in _files(tmp_path)) <= 10_000
    assert not any(p.name.startswith("old-") for p in _files(tmp_path))
    assert any(p.name.startswith("newest-") for p in _files(tmp_path))


def test_a_flush_removes_the_files_of_its_scope(tmp_path: Path) -> None:
    disk = DiskStates(tmp_path, "m", 1 << 20)
    disk.write([_state(("a", "x"), [1], b"1"), _state(("b", None), [2], b"2")])
    disk.index()
    removed, _ = disk.remove(lambda key: scope_matches(key, "tenant", "a", None))
    assert removed == 1 and len(_files(tmp_path)) == 1
    assert disk.remove(lambda key: scope_matches(key, "all", None, None))[0] == 1
    assert _files(tmp_path) == []


def test_the_key_follows_the_file_and_the_settings(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    key = model_key(gguf, n_ctx=2048, type_k=None)
    assert key == model_key(gguf, n_ctx=2048, type_k=None)
    assert key != model_key(gguf, n_ctx=4096, type_k=None)
    assert key != model_key(gguf, n_ctx=2048, type_k="q8_0")
    gguf.write_bytes(b"GGUF" + bytes(101))  # another file at the same path
    assert key != model_key(gguf, n_ctx=2048, type_k=None)


def test_two_writers_on_one_folder_keep_each_others_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas of a model close at once: one's clean-up runs while the other is
    between writing its temporary file and renaming it."""
    first = DiskStates(tmp_path, "m", 1 << 20)
    second = DiskStates(tmp_path, "m", 1 << 20)
    rename = os.replace
    interleaved: list[int] = []

    def replace_after_the_other_wrote(source: str | Path, target: str | Path) -> None:
        if not interleaved:  # the first writer's rename: the second one writes first
            interleaved.append(0)
            interleaved[0] = second.write([_state(("t", None), [2], b"second")])
        rename(source, target)

    monkeypatch.setattr(os, "replace", replace_after_the_other_wrote)
    assert first.write([_state(("t", None), [1], b"first")]) == 1
    assert interleaved == [1]
    reader = DiskStates(tmp_path, "m", 1 << 20)
    reader.index()
    assert sorted(e.tokens for e in reader.entries) == [(1,), (2,)]
    assert list(tmp_path.glob(f"*{PARTIAL}")) == []


def test_a_crashed_writers_leftover_goes_only_once_stale(tmp_path: Path) -> None:
    stale = tmp_path / f"m-dead.1{PARTIAL}"
    fresh = tmp_path / f"m-busy.2{PARTIAL}"
    for leftover in (stale, fresh):
        leftover.write_bytes(b"half a state")
    long_ago = time.time() - STALE_PARTIAL_S - 60
    os.utime(stale, (long_ago, long_ago))
    DiskStates(tmp_path, "m", 1 << 20).write([_state(("t", None), [1], b"x")])
    assert not stale.exists()
    assert fresh.exists()  # perhaps another writer's, still under way
