"""The reasoning splitter that OpenAI's Responses API and Anthropic's Messages share
(pool/http/_thinking.py): what each reply splits into, what each piece gives as it
arrives (reasoning streams before its closing tag), and, wherever a runtime cuts its
pieces, a streamed reply splits as the whole reply does."""

from __future__ import annotations

import itertools
import random

import pytest

from pool.http._thinking import ThinkSplitter, split_reasoning

# reply -> (reasoning, text) as OpenAI keeps it (the reasoning's last whitespace kept),
# and as Anthropic does (trimmed).
SPLITS: dict[str, tuple[tuple[str | None, str], tuple[str | None, str]]] = {
    "<think>\nplan\n</think>\n\nanswer": (("plan\n", "answer"), ("plan", "answer")),
    "  <think> Paris is the capital. </think> It is Paris.": (
        ("Paris is the capital. ", "It is Paris."),
        ("Paris is the capital.", "It is Paris."),
    ),
    "<think>\n\nstep one\n\nstep two\n\n</think>\n\nDone.\n": (
        ("step one\n\nstep two\n\n", "Done.\n"),
        ("step one\n\nstep two", "Done.\n"),
    ),
    "<think></think>\n\nNo thoughts.": (("", "No thoughts."), ("", "No thoughts.")),
    "<think>\nnever closed\n": (("never closed\n", ""), ("never closed", "")),
    "no reasoning at all\n": ((None, "no reasoning at all\n"), (None, "no reasoning at all\n")),
    "  <thin not a tag": ((None, "  <thin not a tag"), (None, "  <thin not a tag")),
    "<think>a < b and </thi is not the end</think>x": (
        ("a < b and </thi is not the end", "x"),
        ("a < b and </thi is not the end", "x"),
    ),
}
REPLIES = list(SPLITS)


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


@pytest.mark.parametrize("trim", [False, True], ids=["openai", "anthropic"])
@pytest.mark.parametrize("reply", REPLIES)
def test_each_reply_splits_into_its_reasoning_and_answer(reply: str, trim: bool) -> None:
    expected = SPLITS[reply][trim]
    assert split_reasoning(reply, trim_reasoning_end=trim) == expected
    # Streamed one character at a time, the pieces add up to the same split.
    reasoning, text = _streamed(reply, tuple(range(1, len(reply))), trim)
    assert (reasoning if expected[0] is not None else None, text) == expected


def _fed(splitter: ThinkSplitter, pieces: list[str]) -> list[list[tuple[str, str]]]:
    """What each piece gives as it arrives, then what the flush gives."""
    return [list(splitter.feed(piece)) for piece in pieces] + [list(splitter.flush())]


def test_reasoning_streams_before_its_closing_tag_arrives() -> None:
    """Each piece of reasoning is given as it comes, long before ``</think>``; only a
    possible tag (a cut ``</th``) is held back, and let go once the next piece shows it
    was reasoning after all."""
    pieces = ["<think>\n", "The user", " asks about ", "a </th", "eme. ", "</think>"]
    pieces += ["\n\nIt is", " Paris."]
    assert _fed(ThinkSplitter(), pieces) == [
        [],
        [("reasoning", "The user")],
        [("reasoning", " asks about ")],
        [("reasoning", "a ")],
        [("reasoning", "</theme. ")],
        [],
        [("text", "It is")],
        [("text", " Paris.")],
        [],
    ]


def test_trimmed_reasoning_holds_only_its_trailing_whitespace() -> None:
    """Anthropic's blocks drop the whitespace that ends the reasoning: that whitespace
    waits for the next piece; the words before it do not."""
    pieces = ["<think>", " \nstep one\n\n", "step two\n", "</thi", "nk>", "\n", "Done."]
    assert _fed(ThinkSplitter(trim_reasoning_end=True), pieces) == [
        [],
        [("reasoning", "step one")],
        [("reasoning", "\n\nstep two")],
        [],
        [],
        [],
        [("text", "Done.")],
        [],
    ]


def test_a_reply_without_reasoning_is_text_as_soon_as_it_cannot_be_a_tag() -> None:
    # "<thi" might still open <think>: held; "<this" cannot, and goes out whole.
    assert _fed(ThinkSplitter(), ["  <thi", "s is", " text"]) == [
        [],
        [("text", "  <this is")],
        [("text", " text")],
        [],
    ]
    assert _fed(ThinkSplitter(), ["Hello", " world"]) == [
        [("text", "Hello")],
        [("text", " world")],
        [],
    ]
    # A reply that ends while it still might have been a tag is text.
    assert _fed(ThinkSplitter(), [" <th"]) == [[], [("text", " <th")]]
    # Unclosed reasoning is given as it comes; the flush has what was held back.
    assert _fed(ThinkSplitter(), ["<think>never", " closed</th"]) == [
        [("reasoning", "never")],
        [("reasoning", " closed")],
        [("reasoning", "</th")],
    ]


def test_what_each_dialect_keeps_of_the_reasoning() -> None:
    reply = "<think>\nplan\n</think>\n\nanswer"
    assert split_reasoning(reply) == ("plan\n", "answer")
    assert split_reasoning(reply, trim_reasoning_end=True) == ("plan", "answer")
    assert split_reasoning("<think></think>x", trim_reasoning_end=True) == ("", "x")
    assert split_reasoning("plain") == (None, "plain")
