"""The vram-swap benchmark's reference and a short replay of it (virtual time)."""

from __future__ import annotations

import trio

from benchmarks.vram_swap import belady, vram_swap


def test_belady_evicts_what_is_needed_furthest_ahead() -> None:
    # Two slots: at c, a is needed again next and b never, so b goes.
    assert belady(list("abcab"), 2) == ["a", "b", "c", "b"]
    assert belady(list("abcabc"), 3) == ["a", "b", "c"]
    # One slot: every change of model is a load.
    assert belady(list("aabba"), 1) == ["a", "b", "a"]


def test_the_short_replay_serves_every_request_and_costs_less_than_lru() -> None:
    report = trio.run(vram_swap, True)
    rows = {(r["rate_per_s"], r["policy"]): r for r in report["rows"]}
    assert all(r["errors"] in (0, None) for r in rows.values())
    # Where swaps seldom overlap, choosing by swap cost spends less time loading than LRU.
    for cost, lru in [
        ("swap-cost policy", "LRU, warm promotion"),
        ("swap-cost, no warm promotion", "plain LRU"),
    ]:
        assert rows[(1.0, cost)]["swap_s"] < rows[(1.0, lru)]["swap_s"]
    # No policy starves a request: every one was answered within its queue timeout.
    assert all(r["max_ms"] is None or r["max_ms"] < 600_000 for r in rows.values())
