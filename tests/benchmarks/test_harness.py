"""The benchmark harness still runs: a quick scenario end to end, results written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_quick_overhead_scenario_writes_results(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks", "run", "overhead-stub", "--quick"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "overhead-stub" / "results.json").read_text())
    cells = {row["cell"] for row in report["rows"]}
    assert cells == {"json c=1", "json c=8", "sse-100 c=1", "sse-100 c=8"}
    for row in report["rows"]:
        assert row["pool_rps"] > 0 and row["bare_rps"] > 0
    assert report["raw"]["json c=1"]["pool"][0]["errors"] == 0
    assert [row["offered_rate"] for row in report["open_loop"]] == ["100/s", "300/s"]
    assert all(row["pool_errors"] == 0 and row["pool_p50_ms"] > 0 for row in report["open_loop"])
    assert (tmp_path / "overhead-stub" / "results.md").read_text().startswith("# overhead-stub")
