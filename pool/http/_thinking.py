"""A reply's reasoning, split from its text as the pieces arrive.

Thinking models write their reasoning between ``<think>`` and ``</think>`` at the start
of the reply (Qwen3, DeepSeek-R1 and their templates). The dialects that show reasoning
on its own (OpenAI's Responses API as a ``reasoning`` item, Anthropic's Messages as a
``thinking`` block) split it with :class:`ThinkSplitter`, streamed or not, so a plain
answer and a streamed one agree wherever the runtime cut its pieces.
"""

from __future__ import annotations

from typing import Literal

OPEN_THINK = "<think>"
CLOSE_THINK = "</think>"

Kind = Literal["reasoning", "text"]


class ThinkSplitter:
    """Text pieces as they come, split into reasoning and answer text.

    Only a reply that opens with ``<think>`` (after whitespace) has reasoning; it ends
    at ``</think>``; the whitespace that opens the reasoning and that follows the
    closing tag is dropped. Any other reply is text as it came. A tag cut across
    pieces is held back until the next piece decides it.

    Args:
        trim_reasoning_end: drop the whitespace that ends the reasoning too (Anthropic's
            blocks). It is held back until the next piece shows whether more reasoning
            or the closing tag follows it.
    """

    def __init__(self, *, trim_reasoning_end: bool = False) -> None:
        self._trim_end = trim_reasoning_end
        self._state: Literal["start", "reasoning", "text"] = "start"
        self._held = ""
        self._strip = False  # drop the whitespace that opens the next text
        self.opened = False  # the reply opened with <think>

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        held = self._held + text
        self._held = ""
        while held:
            if self._state == "start":
                stripped = held.lstrip()
                if stripped.startswith(OPEN_THINK):
                    self._state = "reasoning"
                    self.opened = True
                    held = stripped[len(OPEN_THINK) :].lstrip()
                    self._strip = not held
                    continue
                if not stripped or OPEN_THINK.startswith(stripped):
                    self._held = held  # undecided: whitespace or a cut "<thi"
                    return out
                self._state = "text"
                continue
            if self._state == "reasoning":
                if self._strip:
                    held = held.lstrip()
                    if not held:
                        return out
                    self._strip = False
                end = held.find(CLOSE_THINK)
                if end >= 0:
                    reasoning = held[:end].rstrip() if self._trim_end else held[:end]
                    if reasoning:
                        out.append(("reasoning", reasoning))
                    held = held[end + len(CLOSE_THINK) :]
                    self._state = "text"
                    self._strip = True
                    continue
                sure = len(held) - _partial_tail(held, CLOSE_THINK)
                if self._trim_end:
                    sure = len(held[:sure].rstrip())
                if sure:
                    out.append(("reasoning", held[:sure]))
                self._held = held[sure:]
                return out
            if self._strip:
                held = held.lstrip()
                if not held:
                    return out
                self._strip = False
            out.append(("text", held))
            return out
        return out

    def flush(self) -> list[tuple[Kind, str]]:
        """What is held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._state == "reasoning" and self._trim_end:
            held = held.rstrip()
        if not held:
            return []
        # Held at the start (whitespace, a cut "<thi") it was text after all.
        return [("reasoning" if self._state == "reasoning" else "text", held)]


def split_reasoning(text: str, *, trim_reasoning_end: bool = False) -> tuple[str | None, str]:
    """``(reasoning, text)`` of a whole reply, as :class:`ThinkSplitter` splits its
    pieces; reasoning is None when the reply does not open with ``<think>``."""
    splitter = ThinkSplitter(trim_reasoning_end=trim_reasoning_end)
    pieces = splitter.feed(text) + splitter.flush()
    reasoning = "".join(p for kind, p in pieces if kind == "reasoning")
    answer = "".join(p for kind, p in pieces if kind == "text")
    return (reasoning if splitter.opened else None), answer


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that starts ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
