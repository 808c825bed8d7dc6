"""The fault soak's "disk full" where mount is not allowed (benchmarks/soak_faults.py,
``StateDisk``): the writer's file-size limit set to 0 makes its writes fail with EFBIG,
the process lives on (Python ignores SIGXFSZ), and clearing lets it write again."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.soak_faults import StateDisk

# Appends a line to a file in the state folder every 20 ms, printing ok or the errno.
WRITER = """
import sys, time
path = sys.argv[1]
while True:
    try:
        with open(path, "a") as out:
            out.write("x" * 100 + "\\n")
        print("ok", flush=True)
    except OSError as exc:
        print(f"errno {exc.errno}", flush=True)
    time.sleep(0.02)
"""


def _next_lines(process: subprocess.Popen[str], count: int) -> list[str]:
    assert process.stdout is not None
    return [process.stdout.readline().strip() for _ in range(count)]


def test_a_file_size_limit_fills_the_disk_for_the_pool_only(tmp_path: Path) -> None:
    disk = StateDisk(tmp_path, mount=False)
    assert disk.method == "rlimit_fsize"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(disk.path / "usage.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _next_lines(writer, 3) == ["ok"] * 3
        disk.pids = [writer.pid]
        disk.fill()
        time.sleep(0.1)  # lines written before the limit may still be in the pipe
        lines = _next_lines(writer, 20)
        assert lines[-5:] == ["errno 27"] * 5  # EFBIG
        assert writer.poll() is None  # SIGXFSZ did not kill it
        # The benchmark itself may still write there (only the pool is limited).
        (disk.path / "probe").write_text("fine")
        disk.clear()
        time.sleep(0.1)
        assert _next_lines(writer, 20)[-5:] == ["ok"] * 5
    finally:
        writer.kill()
        writer.wait()
        disk.close()
