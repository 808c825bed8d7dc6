"""Output canaries, the pure part: whether a model is probed and how, what an answer
says of it, and how many reloads an hour allows (docs/reliability.md, "Output canaries").

A runtime can stay alive and answer nonsense (nothing at all, or garbage) until someone
restarts it. Greedy decoding on one build is deterministic, so a short greedy probe
answered once while the model was sound is a reference the later answers must keep to,
within a bound that allows for a runtime's documented nondeterminism (a near-tie token
that flips with the batch or the cache state, after which the texts part ways). These
are functions of facts; the watch (``_canary_watch.py``) runs the probes and acts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from pool.actors.models._probe import ProbeAnswer
from pool.backends import (
    CacheScope,
    Capabilities,
    Decoding,
    GenerationRequest,
    TextPart,
    Turn,
)
from pool.config import EngineSettings, ModelDefinition

# The span the reload budget counts over (engine.canary_reloads_per_hour).
HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class CanaryPlan:
    """One model's canary settings, resolved against the engine's defaults."""

    interval_s: float
    prompt: str
    reference: str | None  # pinned by the operator (canary_reference)
    max_tokens: int
    min_similarity: float
    reloads_per_hour: int


def canary_plan(
    definition: ModelDefinition, engine: EngineSettings, capabilities: Capabilities
) -> CanaryPlan | None:
    """The canary of a model, or None where it has none: a model that does not generate
    text, a remote model that sets no ``canary_interval_s`` of its own (a probe would
    leave the machine, and be billed), or an interval of 0."""
    if not capabilities.generation:
        return None
    interval = definition.canary_interval_s
    if interval is None:
        interval = 0.0 if capabilities.remote else engine.canary_interval_s
    if interval <= 0:
        return None
    return CanaryPlan(
        interval_s=interval,
        prompt=definition.canary_prompt or engine.canary_prompt,
        reference=definition.canary_reference,
        max_tokens=engine.canary_max_tokens,
        min_similarity=engine.canary_min_similarity,
        reloads_per_hour=engine.canary_reloads_per_hour,
    )


def canary_request(model: str, plan: CanaryPlan, request_id: str) -> GenerationRequest:
    """The probe: the canary prompt, greedy, nothing reused from or left in a prompt
    cache that a tenant's request could find."""
    return GenerationRequest(
        request_id=request_id,
        model=model,
        turns=(Turn("user", (TextPart(plan.prompt),)),),
        decoding=Decoding(temperature=0.0, top_k=1, top_p=1.0, max_tokens=plan.max_tokens),
        cache=CacheScope(tenant="", enabled=False),
    )


def judge(
    answer: ProbeAnswer,
    reference: str | None,
    *,
    reference_tokens: int | None,
    min_similarity: float,
) -> str | None:
    """Why ``answer`` shows a degraded model; None when it is sound.

    Degraded: the probe failed; the answer is empty (blank); it ended at once (one
    token or none, where the reference took more); or it differs from ``reference``
    beyond the bound (difflib's ratio of the two texts below ``min_similarity``).
    Without a reference only the first two apply.
    """
    if answer.error is not None:
        return f"the probe failed: {answer.error}"
    text = answer.text.strip()
    if not text:
        return f"empty answer ({_ending(answer)})"
    if reference is None:
        return None
    expected = reference.strip()
    tokens = answer.output_tokens
    if tokens is not None and tokens <= 1 and (reference_tokens or 0) > 1:
        return f"ended at once: {text!r} ({_ending(answer)}; the reference took {reference_tokens})"
    ratio = similarity(expected, text)
    if ratio < min_similarity:
        return (
            f"differs from the reference: {text!r} against {expected!r}"
            f" (similarity {ratio:.2f}, engine.canary_min_similarity {min_similarity:g})"
        )
    return None


def similarity(reference: str, answer: str) -> float:
    """How alike two answers are: 1 identical, 0 nothing in common (difflib's ratio)."""
    return difflib.SequenceMatcher(None, reference, answer, autojunk=False).ratio()


def reloads_within_hour(reloads: Iterable[float], now: float) -> int:
    """How many of the reloads (Trio clock times) were in the hour before ``now``."""
    return sum(1 for at in reloads if now - at < HOUR_S)


def may_reload(reloads: Iterable[float], now: float, per_hour: int) -> bool:
    """Whether a degraded model may be reloaded once more (else it is marked failed)."""
    return reloads_within_hour(reloads, now) < per_hour


def _ending(answer: ProbeAnswer) -> str:
    tokens = "?" if answer.output_tokens is None else answer.output_tokens
    return f"{tokens} token(s), finish_reason {answer.finish_reason}"
