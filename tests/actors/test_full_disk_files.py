"""The state directory's other files on a full disk (docs/faults.md): the
measured VRAM footprints are logged as not saved, nothing raises, and the next save
after space returns writes them. The full disk is the kernel's own: ``/dev/full``
answers every write with ENOSPC."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from pool.actors.residency import _footprints
from pool.actors.residency._footprints import FILE_NAME, FootprintStore

FULL = Path("/dev/full")


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")
async def test_footprints_not_saved_on_a_full_disk_are_saved_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / FILE_NAME
    store = FootprintStore(path)
    store.record("m", "load-key", 1, 1234)

    def on_a_full_disk(prefix: str, dir: Path) -> tuple[int, str]:
        # The temporary file the save writes before its rename: one that is full.
        return os.open(FULL, os.O_WRONLY), str(Path(dir) / f"{prefix}gone")

    with monkeypatch.context() as patched, caplog.at_level(logging.WARNING):
        patched.setattr(_footprints.tempfile, "mkstemp", on_a_full_disk)
        await store.save()  # logged, never raised
    assert FILE_NAME not in os.listdir(tmp_path)
    [line] = [r for r in caplog.records if "vram footprints not saved" in r.getMessage()]
    assert os.strerror(errno.ENOSPC) in line.getMessage()
    await store.save()  # space is back
    again = FootprintStore(path)
    again.read()
    assert again.lookup("m", "load-key", 1) == 1234
