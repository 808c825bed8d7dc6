"""A bound on a wait for an event, never a measure of how fast it came.

Tests wait for what they expect to happen (a message, a state, a counter) instead of
sleeping; the wait is bounded only so that an event that never comes fails the test
saying which one, instead of hanging it. The bound is far past what the event takes on a
loaded machine: a tight one would assert a timing, and fail on a slow runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trio

# Long enough for any event of the suite on a shared CI machine, short of the per-test
# timeout (pyproject.toml) so that the failure names the event.
EVENT_BOUND_S = 60.0


@contextmanager
def within(what: str, seconds: float = EVENT_BOUND_S) -> Iterator[None]:
    """Fail the test, naming ``what``, if the block has not finished after ``seconds``."""
    try:
        with trio.fail_after(seconds):
            yield
    except trio.TooSlowError:
        pytest.fail(f"{what}: not after {seconds:g} s", pytrace=False)
