"""The fault soak's pure parts (benchmarks/soak_windows.py): the schedule's scaling,
which window a request is charged to, recovery times and the expectation checks."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.soak_windows import (
    FAULTS,
    GRACE_S,
    LEAD_SHARE,
    RECOVER_LIMIT_S,
    STORED_AND_KEPT,
    Request,
    Window,
    attribute,
    check_window,
    first_success_after,
    is_error,
    outside_errors,
    schedule,
    usage_lost,
)


def test_a_ten_minute_run_injects_every_fault_once() -> None:
    slots = schedule(10)
    assert [s.fault for s in slots] == list(FAULTS)
    assert slots[0].inject_at >= 30  # after the warm-up
    assert slots[-1].inject_at + slots[-1].hold_s < 600
    # The nominal holds fit a 10-minute run's slots: Redis 30 s, the burst 20 s.
    holds = {s.fault: s.hold_s for s in slots}
    assert holds["redis"] == 30 and holds["burst"] == 20 and holds["kill"] == 0


def test_an_hour_injects_every_fault_six_times_in_order() -> None:
    slots = schedule(60)
    assert len(slots) == 30
    assert [s.fault for s in slots] == list(FAULTS) * 6
    starts = [s.inject_at for s in slots]
    assert starts == sorted(starts)
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(starts)}
    assert len(gaps) == 1  # evenly spread
    assert starts[-1] + slots[-1].slot_s * (1 - LEAD_SHARE) == pytest.approx(3600)


@pytest.mark.parametrize("minutes", [2, 3, 5])
def test_a_short_run_still_has_every_fault_with_holds_scaled_down(minutes: float) -> None:
    slots = schedule(minutes)
    assert [s.fault for s in slots] == list(FAULTS)
    for slot in slots:
        assert slot.hold_s <= 0.4 * slot.slot_s + 1e-9
        assert slot.inject_at + slot.slot_s * (1 - LEAD_SHARE) <= minutes * 60 + 1e-6


def _request(start: float, end: float, outcome: str = "ok", **kw: object) -> Request:
    fields = {"kind": "steady", "model": "steady", "status": 200 if outcome == "ok" else 0}
    fields.update(kw)
    return Request(start=start, end=end, outcome=outcome, **fields)  # type: ignore[arg-type]


def test_requests_are_charged_to_the_window_they_overlap() -> None:
    windows = [
        Window("burst", inject_at=100, cleared_at=120, recovered_at=121),  # ends 126
        Window("kill", inject_at=200, cleared_at=200, recovered_at=None),  # ends 200+60+5
    ]
    before = _request(90, 99.9)
    straddling = _request(95, 101)  # began before, ended inside
    in_grace = _request(125, 127)  # inside the grace after recovery
    after = _request(126.5, 130)
    kill_late = _request(250, 264)
    after_kill = _request(266, 270)
    requests = [before, straddling, in_grace, after, kill_late, after_kill]
    attribute(requests, windows)
    assert [r.window for r in requests] == [None, "burst#0", "burst#0", None, "kill#1", None]
    assert windows[0].end == 121 + GRACE_S
    assert windows[1].end == 200 + RECOVER_LIMIT_S["kill"] + GRACE_S


def test_recovery_is_the_first_success_that_started_after_clearing() -> None:
    assert first_success_after(50.0, [10.0, 49.9, 53.5, 51.2]) == 51.2
    assert first_success_after(50.0, [10.0, 20.0]) is None
    window = Window("redis", inject_at=20, cleared_at=50, recovered_at=51.2)
    assert window.recovery_s == pytest.approx(1.2)


def test_what_counts_as_an_error() -> None:
    assert not is_error(_request(0, 1))
    assert not is_error(_request(0, 1, "client_left"))
    assert not is_error(_request(0, 1, "http", status=503, code="queue_full", retry_after=True))
    assert is_error(_request(0, 1, "http", status=503, code="queue_full", retry_after=False))
    assert is_error(_request(0, 1, "http", status=504, code="backend_timeout"))
    assert is_error(_request(0, 1, "error_event", code="backend_error"))
    assert is_error(_request(0, 1, "cut"))
    churn = _request(0, 1, "http", status=409, code="model_not_loaded", kind="churn")
    assert not is_error(churn)
    assert is_error(_request(0, 1, "http", status=409, code="model_not_loaded"))


def test_errors_outside_windows_are_the_ones_no_fault_explains() -> None:
    windows = [Window("burst", inject_at=10, cleared_at=30, recovered_at=31)]
    inside = _request(12, 13, "http", status=503, code="queue_full")
    outside = _request(50, 51, "error_event", code="backend_error")
    fine = _request(50, 51)
    attribute([inside, outside, fine], windows)
    assert outside_errors([inside, outside, fine]) == [outside]


def test_a_kill_that_ends_streams_with_an_error_event_and_comes_back_passes() -> None:
    window = Window("kill", inject_at=100, cleared_at=100, recovered_at=104)
    window.notes = {"target_model": "smol-srv", "came_back_by_itself": True}
    requests = [
        _request(98, 100.1, "error_event", code="backend_error", model="smol-srv"),
        _request(100.2, 100.3, "http", status=409, code="model_failed", model="smol-srv"),
        _request(99, 101, model="smol"),
    ]
    attribute(requests, [window])
    assert check_window(window, "kill#0", requests) == []


def test_a_kill_fails_on_a_silent_cut_a_manual_reload_and_a_hurt_bystander() -> None:
    window = Window("kill", inject_at=100, cleared_at=100, recovered_at=170)
    window.notes = {"target_model": "smol-srv", "came_back_by_itself": False}
    requests = [
        _request(98, 100.1, "cut", model="smol-srv"),
        _request(99, 101, "error_event", code="backend_error", model="smol"),
    ]
    attribute(requests, [window])
    failures = check_window(window, "kill#0", requests)
    assert any("over the 60s limit" in f for f in failures)
    assert any("cut without an error event" in f for f in failures)
    assert any("did not come back by itself" in f for f in failures)
    assert any("other traffic failed" in f and "smol" in f for f in failures)


def test_a_hang_must_end_its_requests_with_backend_timeout_and_be_recycled() -> None:
    window = Window("hang", inject_at=100, cleared_at=120, recovered_at=125)
    window.notes = {"target_model": "smol-srv", "recycled": True}
    timed_out = _request(99, 115, "error_event", code="backend_timeout", model="smol-srv")
    attribute([timed_out], [window])
    assert check_window(window, "hang#0", [timed_out]) == []
    window.notes["recycled"] = False
    other = _request(99, 115, "error_event", code="backend_error", model="smol-srv")
    attribute([timed_out, other], [window])
    failures = check_window(window, "hang#0", [timed_out, other])
    assert len(failures) == 2
    assert "backend_timeout" in failures[0] and "error event backend_error" in failures[0]
    assert "watchdog" in failures[1]


def test_disk_full_wants_507_for_stored_responses_and_everything_else_served() -> None:
    window = Window("disk_full", inject_at=10, cleared_at=40, recovered_at=41)
    window.notes = {"stored_during": [507, STORED_AND_KEPT, 507]}
    served = _request(20, 21)
    assert check_window(window, "disk_full#0", [served]) == []
    # A 200 for a response that was not kept is a lie; a 500 is no clear error.
    for wrong in (200, 500):
        window.notes = {"stored_during": [507, wrong]}
        refused = _request(20, 21, "http", status=500, code="internal_error")
        attribute([served, refused], [window])
        failures = check_window(window, "disk_full#0", [served, refused])
        assert any(f"['{wrong}']" in f and "neither 507" in f for f in failures), failures
        assert any("not served" in f for f in failures)


def test_a_burst_refusal_must_say_when_to_come_back() -> None:
    window = Window("burst", inject_at=10, cleared_at=30, recovered_at=30.5)
    bare = _request(12, 12.1, "http", status=503, code="queue_full", retry_after=False)
    polite = _request(12, 12.1, "http", status=429, code="queue_full", retry_after=True)
    attribute([bare, polite], [window])
    failures = check_window(window, "burst#0", [bare, polite])
    assert any("1 refusal(s) without Retry-After" in f for f in failures)


def test_redis_outage_excuses_only_cluster_traffic() -> None:
    window = Window("redis", inject_at=10, cleared_at=40, recovered_at=42)
    relayed = _request(20, 21, "http", status=502, code="backend_error", kind="cluster")
    assert check_window(window, "redis#0", [relayed]) == []
    local = _request(20, 21, "http", status=500, code="internal_error")
    attribute([relayed, local], [window])
    assert check_window(window, "redis#0", [relayed, local]) != []


def test_usage_rows_may_be_missing_only_inside_disk_full_windows() -> None:
    rows, failures = usage_lost(
        expected={"steady": 100, "store": 10, "cluster": 50},
        recorded={"steady": 97, "store": 10, "cluster": 51},
        in_disk_full={"steady": 3},
    )
    assert [r["missing"] for r in rows] == [-1, 3, 0]  # sorted: cluster, steady, store
    assert failures == ["usage cluster: 51 rows for 50 requests (counted twice)"]
    _, failures = usage_lost({"steady": 100}, {"steady": 90}, {"steady": 4})
    assert failures == ["usage steady: 10 rows missing, 6 outside disk-full windows"]


def test_an_injection_that_failed_is_a_failure_of_its_window() -> None:
    window = Window("disk_full", inject_at=10, cleared_at=10, recovered_at=11)
    window.notes = {"error": "PermissionError(13, 'Permission denied')"}
    failures = check_window(window, "disk_full#0", [])
    assert failures == [
        "disk_full#0: the injection failed: PermissionError(13, 'Permission denied')"
    ]


def test_every_missing_usage_row_must_be_counted_as_dropped() -> None:
    _, failures = usage_lost(
        {"steady": 100, "smol": 10}, {"steady": 95, "smol": 8}, {"steady": 5, "smol": 2}, dropped=7
    )
    assert failures == []
    _, failures = usage_lost(
        {"steady": 100, "smol": 10}, {"steady": 95, "smol": 8}, {"steady": 5, "smol": 2}, dropped=6
    )
    assert failures == ["usage: 7 rows missing, 6 counted as dropped"]


def test_a_failed_connection_is_labelled_with_how_it_failed() -> None:
    """A burst's failure said only "transport"; the label now names the exception, so
    a failure in a window can be told apart (a refused connect, a server that closed)."""
    closed = _request(0, 1, "transport", code="RemoteProtocolError: Server disconnected")
    assert closed.label == "transport RemoteProtocolError: Server disconnected"
    assert _request(0, 1, "timeout").label == "timeout"
    assert _request(0, 1, "http", status=503, code="queue_full").label == "http 503 queue_full"
