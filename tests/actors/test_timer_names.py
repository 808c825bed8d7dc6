"""One name per measured interval: every layer that carries a timer names it as
:class:`Timings` does (the wire renderers alone spell them otherwise)."""

from __future__ import annotations

import dataclasses

import pytest

from pool.actors.accounting._usage_store import UsageRecord
from pool.actors.models._ticket import JobEmbedded, JobFinished
from pool.actors.values._events import Timings
from pool.backends import GenerationStats

TIMERS = {f.name for f in dataclasses.fields(Timings)}


@pytest.mark.parametrize("carrier", [GenerationStats, JobFinished, JobEmbedded, UsageRecord])
def test_every_timer_a_layer_carries_has_the_pool_s_name(carrier: type) -> None:
    timers = {f.name for f in dataclasses.fields(carrier) if f.name.endswith("_ms")}
    assert timers, carrier
    assert timers <= TIMERS, f"{carrier.__name__}: {sorted(timers - TIMERS)} are not Timings names"
