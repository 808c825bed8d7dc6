"""Pass-through relay: the upstream's own Chat Completions bytes, forwarded.

When the client speaks the upstream's dialect and nothing in the pool needs the tokens
(:class:`~pool.backends.PassThrough`), parsing every event into a neutral delta and
rendering it again buys nothing: it was most of the pool's CPU per relayed token. Here the
upstream's Server-Sent Events go to the client as they came, with byte-level edits only:

- ``model`` becomes the name the client asked for. The upstream's spelling of the field
  (``"model":"<served name>"``) is learnt from its first event and replaced in each batch
  with one ``bytes.replace``: a JSON string escapes its quotes, so that sequence can only
  be the key itself, never text inside a value.
- The upstream is always asked for ``stream_options.include_usage`` (the accounting reads
  the usage event); for a client that did not ask, the usage-only event and every
  ``"usage":null`` are cut, so it gets what it asked for.
- The upstream's ``[DONE]`` is dropped: the renderer sends the pool's own once the
  generation is accounted (as on the translated path).
- Events before the first token (the role-only opening chunk) are held and go out with
  it, so the time to first token is the first token's, as on the translated path.

Reading what the pool must know costs a few C-level scans per batch, never a JSON parse
per event: the usage object (the last one in a batch) and an ``error`` event are parsed
on their own; the finish reason and vLLM's ``stop_reason`` are found with a regex; where
the upstream sends no usage, output tokens are the events that carried a token.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from pool.backends._chat_client import (
    REFUSED_REQUEST,
    UpstreamConnectionFailed,
    usage_cached_tokens,
)
from pool.backends._protocol import GenerationStats, PassThrough, RawSink, TokensUsed
from pool.backends._upstream import Transport, UpstreamError, UpstreamTimeout, upstream_message
from pool.errors import BackendError, PoolError

_MODEL = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')
_FINISH = re.compile(rb'"finish_reason"\s*:\s*"([a-z_]+)"')
_STOP_REASON = re.compile(rb'"stop_reason"\s*:\s*"((?:[^"\\]|\\.)*)"')
# A usage object: flat, or with one level of nesting (prompt_tokens_details).
_USAGE = re.compile(rb'"usage"\s*:\s*(\{(?:[^{}]|\{[^{}]*\})*\})')
# An event that carries a token: non-empty text, reasoning text, or a tool-call piece.
_TOKEN = re.compile(rb'"(?:content|reasoning_content|reasoning)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[')
_TIMINGS = re.compile(rb'"timings"\s*:\s*(\{[^{}]*\})')
_USAGE_NULL = re.compile(rb',\s*"usage"\s*:\s*null')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_DONE = re.compile(rb"^data:\s*\[DONE\]\s*$", re.MULTILINE)
_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


class _Edits:
    """The byte-level edits of one reply (the module's doc)."""

    def __init__(self, ask: PassThrough) -> None:
        self.ask = ask
        self.ours = b'"model":' + json.dumps(ask.model, ensure_ascii=False).encode()
        self.theirs: bytes | None = None

    def model(self, data: bytes) -> bytes:
        if self.theirs is None:
            found = _MODEL.search(data)
            if found is None:
                return data
            self.theirs = found.group(0)
        if self.theirs == self.ours:
            return data
        return data.replace(self.theirs, self.ours)


class _Account:
    """What the pool reads from the events it forwards."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self.events = 0  # every event read
        self.quiet = 0  # those that carried no token: the opening, a finish, the usage
        self.usage_events = 0  # the usage events read (those with no choices)
        self.finish = "stop"
        self.stop_sequence: str | None = None

    @property
    def tokens(self) -> int:
        """The events that carried a token (the charge where no usage comes)."""
        return max(0, self.events - self.quiet)

    def read(self, events: bytes) -> None:
        """Keep count of ``events`` (whole events): every test here is a C-level scan of
        the batch, and a regex runs only where there is something to read (a finish
        reason that is not null, a usage object), about twice a stream."""
        # An event starts a batch or follows a blank line; text has no raw newline.
        self.events += events.count(b"\n\ndata:") + events.startswith(b"data:")
        finishing: list[bytes] = []
        if events.count(b'"finish_reason"') != events.count(b'"finish_reason":null'):
            # Only the events that finish are cut out (once a choice), never every one.
            finishing = _blocks(events, _FINISH)
            if finishing:
                found = _FINISH.findall(finishing[-1])
                self.finish = _REASONS.get(found[-1].decode(), "stop")
                self.quiet += sum(1 for block in finishing if not _TOKEN.search(block))
                if (stop := _STOP_REASON.search(finishing[-1])) is not None:
                    self.stop_sequence = json.loads(b'"' + stop.group(1) + b'"')
        if b'"usage":{' in events or b'"usage": {' in events:
            # The usage event (no choices); or usage in every event (vLLM's continuous
            # stats): then parsed once for the prompt and again where the stream ends.
            closing = len(_EMPTY_CHOICES.findall(events))
            self.quiet += closing
            self.usage_events += closing
            if (closing or finishing or self.usage is None) and (usage := _USAGE.findall(events)):
                self.usage = json.loads(usage[-1])

    def prompt_so_far(self, events: bytes, used: TokensUsed) -> None:
        """The prompt's tokens as soon as the upstream tells them, so that a request cut
        short is charged them (as ``stream_chat`` does): from a usage object, or from
        llama-server's ``timings`` (``prompt_n`` computed plus ``cache_n`` reused)."""
        usage = self.usage or {}
        if isinstance(usage.get("prompt_tokens"), int):
            used.prompt_tokens = usage["prompt_tokens"]
            used.cached_tokens = usage_cached_tokens(usage, None)
        elif b'"timings"' in events and (timings := _TIMINGS.findall(events)):
            found = json.loads(timings[-1])
            if isinstance(found.get("prompt_n"), int):
                cached = found.get("cache_n") if isinstance(found.get("cache_n"), int) else 0
                used.prompt_tokens = found["prompt_n"] + cached
                used.cached_tokens = cached

    def opening(self, events: bytes) -> None:
        """``events`` came while no token had: the events before the first that carries
        one carried none (those after it are tokens, however the upstream split them)."""
        if (first := _TOKEN.search(events)) is not None:
            events = events[: _block_at(events, first.start())[0]]
        self.quiet += sum(
            1
            for block in events.split(b"\n\n")
            if block.startswith(b"data:")
            # a finish event here was counted by read()
            and not _FINISH.search(block)
            and not (_EMPTY_CHOICES.search(block) and _USAGE.search(block))
        )

    def stats(self, started: float, first_ms: float | None) -> GenerationStats:
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        return GenerationStats(
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            cached_tokens=usage_cached_tokens(usage, None) if usage else None,
            # No usage: the events that carried a token (a reply not streamed is then
            # charged as one piece, as the translated path charges what it relayed).
            output_tokens=completion if isinstance(completion, int) else self.tokens or None,
            time_to_first_token_ms=None if first_ms is None else round(first_ms, 3),
            generate_ms=round((time.perf_counter() - started) * 1000.0, 3),
            finish_reason=self.finish,  # type: ignore[arg-type]
            stop_sequence=self.stop_sequence,
            relay_path="pass_through",
        )


_CONTENT = re.compile(rb'"content"\s*:\s*("(?:[^"\\]|\\.)*")')


def relayed_text(events: bytes) -> str:
    """The reply's text in forwarded events (or a reply's body), in one pass at the
    end: what the reply recorder of prefix affinity keeps, without a parse per token."""
    strings = _CONTENT.findall(events)
    if not strings:
        return ""
    return "".join(json.loads(b"[" + b",".join(strings) + b"]"))


def _block_at(events: bytes, at: int) -> tuple[int, int]:
    """Where the event that holds offset ``at`` starts and ends (its blank line included)."""
    start = events.rfind(b"\n\n", 0, at)
    start = 0 if start < 0 else start + 2
    end = events.find(b"\n\n", at)
    return start, len(events) if end < 0 else end + 2


def _blocks(events: bytes, pattern: re.Pattern[bytes]) -> list[bytes]:
    """The events (without their blank line) in which ``pattern`` matches: one regex scan
    of the batch, then a slice a match, so a batch costs no Python step per event."""
    found: list[bytes] = []
    after = 0
    for match in pattern.finditer(events):
        if match.start() < after:  # a second match in the same event
            continue
        start, after = _block_at(events, match.start())
        found.append(events[start:after].rstrip(b"\n"))
    return found


def _pieces_without(
    events: bytes, marker: re.Pattern[bytes], also: re.Pattern[bytes]
) -> list[bytes]:
    """``events`` in pieces, less each event in which both ``marker`` and ``also`` match
    (found from ``marker``'s matches, as :func:`_blocks` finds them)."""
    pieces: list[bytes] = []
    kept = after = 0
    for match in marker.finditer(events):
        if match.start() < after:
            continue
        start, after = _block_at(events, match.start())
        if also.search(events, start, after):
            pieces.append(events[kept:start])
            kept = after
    pieces.append(events[kept:])
    return pieces


def _failure(events: bytes, what: str) -> tuple[bytes, BackendError] | None:
    """The events before an ``error`` event (an upstream that failed mid-stream) and
    what it means; None when there is none."""
    at = 0
    for block in events.split(b"\n\n"):
        if b'"error"' in block:
            data = b"\n".join(
                line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")
            )
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                return events[:at], BackendError(f"{what} sent a malformed stream: {exc}")
            if isinstance(chunk, dict) and "error" in chunk:
                message = f"{what} failed mid-stream: {upstream_message(data)}"
                return events[:at], BackendError(message)
        at += len(block) + 2
    return None


def _client_view(events: bytes, edits: _Edits, usage_event: bool = True) -> bytes:
    """``events`` as the client gets them (the module's doc). ``usage_event``: whether
    the usage event may be among them (:class:`_Account` knows); where it cannot be, no
    scan looks for it. Each test here scans the whole batch, a cost per byte that adds
    up to a share of the pool's time per token, so each runs only where needed."""
    out = edits.model(events)
    if edits.ask.include_usage or b'"usage"' not in out:
        return out
    if usage_event and (b'"usage":{' in out or b'"usage": {' in out):  # dropped
        kept = b"".join(_pieces_without(out, _EMPTY_CHOICES, _USAGE))
        if len(kept) != len(out):
            out = kept
    if b',"usage":null' in out:  # as every upstream here spells it
        out = out.replace(b',"usage":null', b"")
    if b'"usage"' in out:  # another spelling of a null usage (or a usage kept in place)
        out = _USAGE_NULL.sub(b"", out)
    return out


async def relay_stream(
    transport: Transport,
    path: str,
    body: dict[str, Any],
    sink: RawSink,
    ask: PassThrough,
    *,
    headers: dict[str, str] | None = None,
    what: str = "upstream",
) -> GenerationStats:
    """POST ``body`` streamed to ``path`` and forward the upstream's events to ``sink``
    as bytes (``sink`` takes raw bytes: :func:`~pool.backends.takes_raw`).

    Raises as :func:`~pool.backends._chat_client.stream_chat` does, so a failure reaches
    the client as the same error event on both paths.
    """
    options = {**body.get("stream_options", {}), "include_usage": True}
    payload = json.dumps(
        {**body, "stream": True, "stream_options": options}, ensure_ascii=False
    ).encode()
    used = sink.used
    edits = _Edits(ask)
    account = _Account()
    started = time.perf_counter()
    first_ms: float | None = None
    held = b""  # events before the first token
    usage_events_sent = 0  # account.usage_events when the last batch went out

    async def forward(events: bytes) -> None:
        nonlocal first_ms, held, usage_events_sent
        if b'"error"' in events and (failure := _failure(events, what)) is not None:
            # What came before the error goes out first, as on the translated path.
            before, error = failure
            if before:
                await forward(before)
            raise error
        account.read(events)
        used.output_tokens = account.tokens
        if used.prompt_tokens is None:
            account.prompt_so_far(events, used)
        if first_ms is None:
            account.opening(events)
            if not _TOKEN.search(events):
                held += events
                return
            first_ms = (time.perf_counter() - started) * 1000.0
            events, held = held + events, b""
        usage_event = account.usage_events != usage_events_sent
        if out := _client_view(events, edits, usage_event):
            await sink.send(out)
        usage_events_sent = account.usage_events

    pending = b""  # the start of an event whose blank line has not come yet
    done = False
    try:
        async with transport.request("POST", path, body=payload, headers=headers) as response:
            if response.status != 200:
                message = upstream_message(await response.read())
                if response.status in REFUSED_REQUEST:
                    raise PoolError("invalid_request", f"{what} refused the request: {message}")
                raise BackendError(f"{what} answered HTTP {response.status}: {message}")
            # Read on past [DONE] to the end of the body, so the connection can be reused.
            async for chunk in response.chunks():
                if done:
                    continue
                if b"\r" in chunk or pending.endswith(b"\r"):
                    pending = (pending + chunk).replace(b"\r\n", b"\n")
                else:
                    pending += chunk
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                events, pending = pending[: end + 2], pending[end + 2 :]
                if b"[DONE]" in events and (last := _DONE.search(events)) is not None:
                    events, done = events[: last.start()], True
                await forward(events)
            if not done and (tail := pending.strip(b"\n")):
                # A stream that ends without its last blank line still delivers its event.
                await forward(tail + b"\n\n")
            if held:  # a reply without a token (an empty answer): its events all the same
                out, held = _client_view(held, edits), b""
                await sink.send(out)
    except UpstreamTimeout as exc:
        raise PoolError("backend_timeout", f"{what} did not answer in time ({exc})") from exc
    except UpstreamError as exc:
        raise UpstreamConnectionFailed(f"{what} connection failed: {exc}") from exc
    except ValueError as exc:
        raise BackendError(f"{what} sent a malformed stream: {exc}") from exc
    stats = account.stats(started, first_ms)
    used.prompt_tokens = stats.prompt_tokens
    used.cached_tokens = stats.cached_tokens
    used.output_tokens = stats.output_tokens
    return stats


async def relay_reply(
    transport: Transport,
    path: str,
    body: dict[str, Any],
    sink: RawSink,
    ask: PassThrough,
    *,
    headers: dict[str, str] | None = None,
    what: str = "upstream",
) -> GenerationStats:
    """POST ``body`` unstreamed to ``path``; forward the upstream's reply to ``sink`` as
    one piece of bytes with ``model`` rewritten, its usage read for the accounting (the
    object alone is parsed, not the reply)."""
    # Stream options (vLLM's continuous usage) are refused without a stream.
    unstreamed = {name: value for name, value in body.items() if name != "stream_options"}
    payload = json.dumps({**unstreamed, "stream": False}, ensure_ascii=False).encode()
    account = _Account()
    started = time.perf_counter()
    try:
        async with transport.request("POST", path, body=payload, headers=headers) as response:
            data = await response.read()
    except UpstreamTimeout as exc:
        raise PoolError("backend_timeout", f"{what} did not answer in time ({exc})") from exc
    except UpstreamError as exc:
        raise UpstreamConnectionFailed(f"{what} connection failed: {exc}") from exc
    if response.status != 200:
        message = upstream_message(data)
        if response.status in REFUSED_REQUEST:
            raise PoolError("invalid_request", f"{what} refused the request: {message}")
        raise BackendError(f"{what} answered HTTP {response.status}: {message}")
    if not data.lstrip().startswith(b"{"):
        raise BackendError(f"{what} sent a reply that is not a JSON object: {data[:200]!r}")
    try:
        account.read(data)
    except ValueError as exc:
        raise BackendError(f"{what} sent a malformed reply: {exc}") from exc
    first_ms = (time.perf_counter() - started) * 1000.0
    stats = account.stats(started, first_ms)
    sink.used.prompt_tokens = stats.prompt_tokens
    sink.used.output_tokens = stats.output_tokens
    await sink.send(_Edits(ask).model(data))
    return stats
