"""``why [MODEL]``: the pool's residency decisions in words (``GET /v1/admin/decisions``),
and ``load --dry-run``: what a load would do, changing nothing."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

from pool.cli._client import EXIT_OK, Io, PoolClient


def decision_line(decision: dict[str, Any]) -> str:
    """One decision as a sentence, with its time and reason."""
    model, other = decision["model"], decision.get("for")
    what = {
        "place": f"loaded {model}",
        "evict": f"evicted {model} to make room for {other}",
        "wait": f"{model} waits for room",
        "yield": f"asked {model} to make way for {other}",
        "refuse": f"refused to load {model}",
        "comeback": f"{model} comes back",
        "reload": f"reloaded {model} (output canary)",
        "fail": f"marked {model} failed (output canary)",
        "pause": f"paused {model}'s preemptible streams for {other}",
        "cut": f"cut {model}'s preemptible streams for {other}",
        "resume": f"resumed a paused stream of {model}",
    }.get(decision["action"], f"{decision['action']} {model}")
    at = time.strftime("%H:%M:%S", time.localtime(decision["at"]))
    return f"{at} {what}: {decision['reason']}"


async def why(client: PoolClient, io: Io, model: str | None, limit: int) -> int:
    """The latest ``limit`` decisions (about ``model``), oldest first as in a log."""
    query = {"limit": limit, **({"model": model} if model else {})}
    body = await client.call("GET", f"/v1/admin/decisions?{urlencode(query)}")
    decisions = body.get("decisions", [])
    if io.json:
        for decision in reversed(decisions):
            io.emit(decision)
        return EXIT_OK
    if not decisions:
        about = f" about {model}" if model else ""
        io.out.print(f"no residency decision{about} yet", markup=False)
    for decision in reversed(decisions):
        io.out.print(decision_line(decision), markup=False)
    return EXIT_OK


def preview_lines(preview: dict[str, Any]) -> list[str]:
    """``load --dry-run``'s answer in words."""
    name = preview["model"]
    if preview.get("error"):
        lines = [f"{name} would not load ({preview['error']}): {preview['reason']}"]
    else:
        where = ", ".join(
            "+".join(f"GPU {g} ({m} MiB)" for g, m in zip(gpus, mib, strict=False))
            for gpus, mib in zip(preview["gpus"], preview["gpu_split_mib"], strict=False)
        )
        lines = [
            f"{name} would load" + (f" on {where}" if where else "") + f": {preview['reason']}"
        ]
    if preview.get("evict"):
        lines.append(f"it would evict, in order: {', '.join(preview['evict'])}")
    if preview.get("spared_warm"):
        lines.append(
            f"it would spare (in their stay-warm windows): {', '.join(preview['spared_warm'])}"
        )
    if preview.get("wait_for"):
        lines.append(f"waiting for: {', '.join(preview['wait_for'])}")
    expected = preview.get("expected_load_s")
    lines.append(
        "expected load time: "
        + ("unknown (never measured)" if expected is None else f"{expected:.1f}s (measured)")
    )
    return lines
