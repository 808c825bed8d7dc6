"""The pure parts of the fault soak (``benchmarks/soak_faults.py``): when each fault is
injected and for how long, which fault window a request overlapped, how long a fault
took to recover, and which documented expectations a run failed.

Nothing here does I/O or reads a clock: times are seconds since the run started,
passed in, so the unit tests (tests/benchmarks/test_soak_windows.py) can pin them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# The faults, in the order a round injects them (docs/reliability.md, "Soak with faults").
FAULTS = ("kill", "redis", "disk_full", "hang", "burst")
# How long each fault is held at most (seconds): Redis is stopped for 30 s and the burst
# lasts 20 s as issue #45 asks; the disk stays full for 30 s; a hang is held until the
# watchdog acts or this passes (the runner adds the idle timeout); a kill is instant.
NOMINAL_HOLD_S = {"kill": 0.0, "redis": 30.0, "disk_full": 30.0, "hang": 30.0, "burst": 20.0}
# Time after clearing within which the first success must come.
RECOVER_LIMIT_S = {"kill": 60.0, "redis": 30.0, "disk_full": 15.0, "hang": 60.0, "burst": 15.0}
# A window stays open this long after recovery (stragglers of the fault: a queue that
# drains, a relay's connection that reopens).
GRACE_S = 5.0
# The share of a slot the hold may take at most, so a short run still fits every fault.
HOLD_SHARE = 0.4
# Where in its slot a fault starts: after traffic has settled from the previous one.
LEAD_SHARE = 0.15


@dataclass(frozen=True)
class Slot:
    fault: str
    inject_at: float
    hold_s: float
    slot_s: float


def schedule(minutes: float, faults: tuple[str, ...] = FAULTS) -> list[Slot]:
    """One slot per fault per started ten minutes, spread evenly after a warm-up.

    A 10-minute run injects every fault once (a slot of about 108 s each), a 60-minute
    run six times; a shorter run still injects each once, with holds scaled down to fit
    ``HOLD_SHARE`` of the slot.
    """
    total = minutes * 60.0
    warmup = min(30.0, total / 10)
    rounds = max(1, math.floor(minutes / 10))
    count = rounds * len(faults)
    slot_s = (total - warmup) / count
    slots = []
    for index in range(count):
        fault = faults[index % len(faults)]
        hold = min(NOMINAL_HOLD_S[fault], slot_s * HOLD_SHARE)
        slots.append(Slot(fault, warmup + index * slot_s + slot_s * LEAD_SHARE, hold, slot_s))
    return slots


@dataclass
class Window:
    """One injected fault: from ``inject_at`` to ``recovered_at`` (or, never recovered,
    the clearing plus the recovery limit) plus the grace."""

    fault: str
    inject_at: float
    cleared_at: float
    recovered_at: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.cleared_at

    @property
    def end(self) -> float:
        settled = self.recovered_at
        if settled is None:
            settled = self.cleared_at + RECOVER_LIMIT_S[self.fault]
        return max(settled, self.cleared_at) + GRACE_S


def first_success_after(cleared_at: float, successes: list[float]) -> float | None:
    """The end time of the first success that started at or after ``cleared_at``
    (a request that began during the fault and finished after it proves nothing)."""
    later = [t for t in successes if t >= cleared_at]
    return min(later) if later else None


STORED_AND_KEPT = "200 kept"  # a stored response answered 200 and read back after the run


@dataclass
class Request:
    """One request as the client saw it. ``outcome`` is one of ``ok``, ``error_event``
    (a stream that ended with ``response.failed``), ``http`` (a status >= 400),
    ``client_left``, ``timeout``, ``cut`` (a stream that ended with neither a final
    event nor an error: the silent cut the pool must never do) or ``transport`` (the
    connection failed)."""

    kind: str  # the traffic class: steady, store, churn, smol, smol_srv, cluster, burst
    model: str
    start: float
    end: float
    outcome: str
    status: int = 0
    code: str | None = None
    retry_after: bool = False
    window: str | None = None  # "fault#index" it overlapped, set by attribute()
    response_id: str | None = None  # a stored response's id, as its 200 gave it

    @property
    def label(self) -> str:
        if self.outcome == "http":
            return f"http {self.status} {self.code or ''}".strip()
        if self.outcome == "error_event":
            return f"error event {self.code or ''}".strip()
        # A failed connection says how (the exception), so a failure can be told apart.
        return f"{self.outcome} {self.code or ''}".strip()


def window_name(window: Window, index: int) -> str:
    return f"{window.fault}#{index}"


def attribute(requests: list[Request], windows: list[Window]) -> None:
    """Tag each request with the first fault window its lifetime overlapped."""
    spans = [(w.inject_at, w.end, window_name(w, i)) for i, w in enumerate(windows)]
    for request in requests:
        request.window = next(
            (name for start, end, name in spans if request.start < end and request.end > start),
            None,
        )


# Outcomes that are never an error: a success, and a client that chose to leave.
BENIGN = {"ok", "client_left"}
# Refusals a kind of traffic meets by design: churn models are loaded and unloaded under
# it (409 not loaded or unloading, 503 loading); any queue may refuse with a Retry-After.
EXPECTED_CODES = {
    "churn": {"model_not_loaded", "model_unloading", "model_loading", "queue_full"},
}


def is_error(request: Request) -> bool:
    """Whether this ending counts as an error when no fault explains it."""
    if request.outcome in BENIGN:
        return False
    if request.outcome == "http" and request.code in EXPECTED_CODES.get(request.kind, set()):
        return False
    # A queue's refusal that says when to come back is backpressure, not failure.
    return not (request.outcome == "http" and request.status in (429, 503) and request.retry_after)


def endings(requests: list[Request]) -> dict[str, int]:
    return dict(sorted(Counter(f"{r.kind}/{r.model}: {r.label}" for r in requests).items()))


def check_window(window: Window, name: str, requests: list[Request]) -> list[str]:
    """The documented expectations of one fault, as failures (empty: all held)."""
    failures = []
    if "error" in window.notes:
        failures.append(f"{name}: the injection failed: {window.notes['error']}")
    mine = [r for r in requests if r.window == name]
    if window.recovery_s is None:
        failures.append(f"{name}: no success after clearing")
    elif window.recovery_s > RECOVER_LIMIT_S[window.fault]:
        failures.append(
            f"{name}: recovered in {window.recovery_s:.1f}s,"
            f" over the {RECOVER_LIMIT_S[window.fault]:g}s limit"
        )
    cut = [r for r in mine if r.outcome == "cut"]
    if cut:
        failures.append(f"{name}: {len(cut)} stream(s) cut without an error event")
    target = window.notes.get("target_model")
    bystanders = [r for r in mine if r.model != target and is_error(r)]
    if window.fault == "kill":
        bad = [r for r in mine if r.model == target and r.outcome in ("timeout", "transport")]
        if bad:
            failures.append(
                f"{name}: {len(bad)} request(s) on {target} hung or lost the connection"
            )
        if not window.notes.get("came_back_by_itself", False):
            failures.append(f"{name}: {target} did not come back by itself")
    elif window.fault == "hang":
        bad = [r for r in mine if r.model == target and is_error(r) and r.code != "backend_timeout"]
        if bad:
            labels = sorted({r.label for r in bad})
            failures.append(
                f"{name}: {len(bad)} request(s) on {target} did not end with backend_timeout"
                f" ({', '.join(labels)})"
            )
        if not window.notes.get("recycled", False):
            failures.append(f"{name}: no watchdog recycled the hung replica")
    elif window.fault == "disk_full":
        # Where the store still has room (SQLite reuses the pages and the log it has
        # already grown), a response is stored and answered 200; it must then be there.
        stored = window.notes.get("stored_during", [])
        wrong = [s for s in stored if s not in (507, STORED_AND_KEPT)]
        if wrong:
            failures.append(
                f"{name}: stored responses answered {sorted(set(map(str, wrong)))},"
                f" neither 507 nor 200 and kept"
            )
        served = [r for r in mine if r.kind != "store" and is_error(r)]
        if served:
            failures.append(f"{name}: {len(served)} request(s) not served while the disk was full")
        bystanders = []
    elif window.fault == "burst":
        refused = [r for r in mine if r.outcome == "http" and r.status in (429, 503)]
        bare = [r for r in refused if not r.retry_after]
        if bare:
            failures.append(f"{name}: {len(bare)} refusal(s) without Retry-After")
    elif window.fault == "redis":
        # Local serving goes on: only the cluster's own traffic may notice.
        bystanders = [r for r in mine if r.kind != "cluster" and is_error(r)]
    if bystanders:
        labels = Counter(f"{r.model}: {r.label}" for r in bystanders)
        failures.append(f"{name}: other traffic failed: {dict(labels)}")
    return failures


def outside_errors(requests: list[Request]) -> list[Request]:
    return [r for r in requests if r.window is None and is_error(r)]


def usage_lost(
    expected: dict[str, int],
    recorded: dict[str, int],
    in_disk_full: dict[str, int],
    dropped: float | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Usage rows per tenant against the requests the client saw answered: rows may be
    missing only for requests that overlapped a disk-full window, never exceed the
    requests (a double count), and every missing row is counted in the pool's dropped
    metric (``dropped``, where given)."""
    rows, failures = [], []
    for tenant in sorted(expected):
        want, got, excused = expected[tenant], recorded.get(tenant, 0), in_disk_full.get(tenant, 0)
        lost = want - got
        rows.append(
            {
                "tenant": tenant,
                "requests_answered": want,
                "usage_rows": got,
                "missing": lost,
                "in_disk_full_windows": excused,
            }
        )
        if lost < 0:
            failures.append(f"usage {tenant}: {got} rows for {want} requests (counted twice)")
        elif lost > excused:
            failures.append(
                f"usage {tenant}: {lost} rows missing, {lost - excused} outside disk-full windows"
            )
    missing = sum(max(0, row["missing"]) for row in rows)
    if dropped is not None and missing > dropped:
        failures.append(f"usage: {missing} rows missing, {dropped:g} counted as dropped")
    return rows, failures
