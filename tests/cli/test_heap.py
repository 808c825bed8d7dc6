"""`llm-pool serve` settles its heap before the pool opens (pool/cli/_heap.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from pool.cli._heap import YOUNG_THRESHOLD

# Run in a child process: freezing the heap is for the whole process, never the tests'.
_PROBE = textwrap.dedent(
    """
    import gc, json, os, sys
    import pool.http

    async def serve(settings, **kwargs):
        # Where the pool would open and load its models: report the collector, stop.
        print(json.dumps({"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}))
        sys.stdout.flush()
        os._exit(0)

    pool.http.serve = serve
    before = {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}
    print(json.dumps(before))
    from pool.cli._main import main
    main(["serve", "--settings", sys.argv[1]])
    """
)


def test_serve_freezes_the_imported_heap_and_raises_the_young_threshold(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"service": {"log_level": "warning"}, "engine": {"models": {}}}))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(settings)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, at_serve = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert before["frozen"] == 0 and before["threshold"][0] != YOUNG_THRESHOLD
    # The modules imported by then (pool, Trio, Hypercorn, pydantic...) are tens of
    # thousands of objects; a full collection no longer walks them.
    assert at_serve["frozen"] > 20_000
    assert at_serve["threshold"] == [YOUNG_THRESHOLD, *before["threshold"][1:]]
