"""The arithmetic of benchmarks/pertoken_counts.py: marginal counts and the split of
calls by package (the profiling runs themselves are the benchmark's), and its timed
JSON A/B run end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.pertoken_counts import _by_package, _marginal, _wakers


def test_marginal_counts_are_the_difference_per_extra_unit() -> None:
    fewer = ({"python calls": 1_000.0, "a.py:1(f)": 10.0}, 100)
    more = ({"python calls": 4_600.0, "a.py:1(f)": 40.0, "b.py:2(g)": 9.0}, 1_000)
    # 900 more units: 3,600 more calls, 30 more of f, 9 of g (absent from the first run).
    assert _marginal(fewer, more) == {"python calls": 4.0, "a.py:1(f)": 30 / 900, "b.py:2(g)": 0.01}


def test_calls_are_summed_by_where_the_function_lives() -> None:
    figures = {
        "python calls": 99.0,  # a total, not a function: left out
        "~:0(<built-in method builtins.len>)": 5.0,
        "/env/lib/python3.11/site-packages/trio/_core/_run.py:1(spawn_impl)": 2.0,
        "/env/lib/python3.11/site-packages/trio/_channel.py:9(send)": 1.0,
        "/work/main/pool/http/_pipeline.py:155(_http)": 3.0,
        "/usr/lib/python3.11/contextlib.py:104(__init__)": 4.0,
    }
    assert _by_package(figures) == {"builtins": 5.0, "trio": 3.0, "pool": 3.0, "stdlib": 4.0}
    # The wake-up attribution's labels are not functions.
    assert _by_package({"woken by trio/_channel.py:send_nowait": 7.0}) == {}


def test_wake_ups_are_attributed_to_the_waker_and_shared_out_a_level_up() -> None:
    run = "/env/site-packages/trio/_core/_run.py"
    reschedule = (run, 1, "reschedule")
    send_nowait = ("/env/site-packages/trio/_channel.py", 2, "send_nowait")
    loop = (run, 3, "unrolled_run")
    admit = ("/work/pool/actors/models/_model.py", 4, "admit")
    finish = ("/work/pool/actors/models/_replica.py", 5, "finish")
    # cProfile's entries: (primitive calls, calls, own time, total time, callers), a
    # caller's figures being (primitive calls, calls, own time, total time).
    stats = {
        reschedule: (10, 10, 0, 0, {send_nowait: (8, 8, 0, 0), loop: (2, 2, 0, 0)}),
        send_nowait: (4, 4, 0, 0, {admit: (1, 1, 0, 0), finish: (3, 3, 0, 0)}),
        loop: (1, 1, 0, 0, {}),
    }
    assert _wakers(stats) == {
        "trio/_channel.py:send_nowait <- models/_model.py:admit": 2.0,
        "trio/_channel.py:send_nowait <- models/_replica.py:finish": 6.0,
        "_core/_run.py:unrolled_run": 2.0,
    }


def test_the_json_ab_times_both_models_on_both_sides() -> None:
    """``--ab DIR --per-request`` end to end, this checkout against itself: four pools,
    every side timed in every round, the medians and the rounds each side won."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "benchmarks.pertoken_counts", "--ab", str(root)]
    result = subprocess.run(
        [*command, "--per-request", "--rounds", "2", "--requests", "30"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for side in ("stub this", "stub other", "pass_through this", "pass_through other"):
        assert sum(line.startswith("round ") and f" {side}: " in line for line in lines) == 2
        (median,) = [line for line in lines if line.startswith(f"{side}: median ")]
        assert "ms of pool CPU a request" in median and "of 2 rounds" in median
