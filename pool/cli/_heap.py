"""The serving process's garbage collector, set for a heap that is mostly there to stay.

CPython's cyclic collector starts a young collection whenever 700 more container objects
are alive than at the last one, and a full one after ten of the middle generation once
the objects promoted since the last full one are a quarter of the old generation. A
busy pool keeps every in-flight request's objects alive (its ASGI scope, ticket, tasks
and buffers), so at 16 JSON clients the young collections ran 260 times a second, found
nothing to free, and promoted those objects. That brought a full collection every half
second, which walked the whole heap (the imported modules, the app's routes and
schemas: about 120,000 objects) for 65-80 ms with the loop stopped: every stream and
request in flight waited, and it was the p99 (docs/performance.md, "The collector under
load").

The pool leaves almost no cycles per request (at a threshold of 10,000 a 4 s load ran no
collection at all), so the collector has little to find and is told so:

- :data:`YOUNG_THRESHOLD`: a young collection once 10,000 more objects are alive.
  Measured against 700, 2,000, 5,000 and 50,000 at 64 relayed streams: 50,000 made each
  young collection take 20-30 ms (it walks what is alive), below 10,000 they promote
  enough to bring full collections back.
- :func:`settle_heap`, before the pool opens: what is alive once the modules are
  imported is collected once and frozen (``gc.freeze``), so a full collection no longer
  walks it. It runs before any model loads: a model's objects stay collectable, and an
  unloaded model's cycles are freed as before (the backends collect on unload).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Freeze what is alive now and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
