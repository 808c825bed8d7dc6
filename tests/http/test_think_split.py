"""The reasoning splitter that OpenAI's Responses API and Anthropic's Messages share
(pool/http/_thinking.py): wherever a runtime cuts its pieces, a streamed reply splits as
the whole reply does, so a streamed answer and a plain one agree."""

from __future__ import annotations

import itertools
import random

import pytest

from pool.http._thinking import ThinkSplitter, split_reasoning

REPLIES = [
    "<think>\nplan\n</think>\n\nanswer",
    "  <think> Paris is the capital. </think> It is Paris.",
    "<think>\n\nstep one\n\nstep two\n\n</think>\n\nDone.\n",
    "<think></think>\n\nNo thoughts.",
    "<think>\nnever closed\n",
    "no reasoning at all\n",
    "  <thin not a tag",
    "<think>a < b and </thi is not the end</think>x",
]


def _streamed(reply: str, cuts: tuple[int, ...], trim: bool) -> tuple[str, str]:
    splitter = ThinkSplitter(trim_reasoning_end=trim)
    bounds = [0, *cuts, len(reply)]
    pieces = [reply[a:b] for a, b in itertools.pairwise(bounds)]
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.flush()
    reasoning = "".join(text for kind, text in out if kind == "reasoning")
    return reasoning, "".join(text for kind, text in out if kind == "text")


@pytest.mark.parametrize("trim", [False, True], ids=["openai", "anthropic"])
@pytest.mark.parametrize("reply", REPLIES)
def test_every_cut_splits_as_the_whole_reply(reply: str, trim: bool) -> None:
    reasoning, text = split_reasoning(reply, trim_reasoning_end=trim)
    whole = (reasoning or "", text)
    for cut in range(1, len(reply)):
        assert _streamed(reply, (cut,), trim) == whole, (reply, cut)
    rng = random.Random(reply)
    for _ in range(200):
        cuts = tuple(sorted(rng.sample(range(1, len(reply)), min(4, len(reply) - 1))))
        assert _streamed(reply, cuts, trim) == whole, (reply, cuts)
    # One character at a time, as a runtime streams single-character tokens.
    assert _streamed(reply, tuple(range(1, len(reply))), trim) == whole


def test_what_each_dialect_keeps_of_the_reasoning() -> None:
    reply = "<think>\nplan\n</think>\n\nanswer"
    assert split_reasoning(reply) == ("plan\n", "answer")
    assert split_reasoning(reply, trim_reasoning_end=True) == ("plan", "answer")
    assert split_reasoning("<think></think>x", trim_reasoning_end=True) == ("", "x")
    assert split_reasoning("plain") == (None, "plain")
