"""Per-request cost of the actor core alone (no HTTP): ``python -m benchmarks.core_cost N TOKENS``.

Streams N requests of a stub model replying TOKENS words through ``Pool.stream`` and
prints the median microseconds per request. It runs against whichever ``pool`` is on
``PYTHONPATH``, so two checkouts can be compared side by side (see
benchmarks/results/typed-core/results.md).
"""

import statistics
import sys
import time

import trio


async def main(n: int, tokens: int) -> None:
    import pool
    from pool.config import build_settings

    settings = build_settings(
        {
            "engine": {
                "models": {
                    "m": {
                        "backend": "stub",
                        "enabled": True,
                        "stub_reply": " ".join(["w"] * tokens),
                        "target_inflight": 1,
                    }
                }
            }
        }
    )
    async with pool.open_pool(settings) as p:
        if hasattr(pool, "InferenceRequest"):
            req = pool.InferenceRequest.prompt("m", "hi")
        else:  # a checkout from before the typed core (the "before" side of a comparison)
            from pool.schemas import ResponseRequest

            req = ResponseRequest(model="m", input="hi")
        for _ in range(200):  # warm up
            async for _e in p.stream(req):
                pass
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            async for _e in p.stream(req):
                pass
            times.append((time.perf_counter() - t0) * 1e6)
        print(f"{statistics.median(times):.1f}")


trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
