"""benchmarks/loaded_tails.py end to end, this checkout against itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_every_cell_is_timed_on_both_sides_in_every_round() -> None:
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "benchmarks.loaded_tails", "--ab", str(root)]
    result = subprocess.run(
        [*command, "--rounds", "2", "--seconds", "0.3"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for cell in ("json c=16", "sse c=64"):
        for side in ("this", "other"):
            rounds = [
                line for line in lines if line.startswith("round ") and f" {cell} {side}: " in line
            ]
            assert len(rounds) == 2
            (median,) = [
                line for line in lines if line.startswith(f"{cell} {side}: median of 2 rounds")
            ]
            assert " req/s, " in median and " p99 " in median and " stalled " in median
