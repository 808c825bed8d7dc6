"""How tokens travel from a replica to the requester: batches, backpressure, leaving."""

from __future__ import annotations

import contextlib

from pool import Delta, Finished, open_pool

from .helpers import ask, stub_settings, wait_until

WORDS = " ".join(f"w{i}" for i in range(10))


async def test_a_reader_that_falls_behind_gets_the_backlog_in_one_batch() -> None:
    settings = stub_settings({"m": {"stub_reply": WORDS, "enabled": True}})
    async with open_pool(settings) as pool, pool.admit(ask("m")) as admission:
        channel = admission.ticket.receive_channel
        # The unpaced stub writes its whole reply while nobody reads.
        await wait_until(lambda: channel.statistics().current_buffer_used == 11)
        batches = [batch async for batch in admission.batches()]
    assert len(batches) == 1
    *deltas, finished = batches[0]
    assert "".join(d.text for d in deltas if isinstance(d, Delta)) == WORDS
    assert len(deltas) == 10
    assert isinstance(finished, Finished) and finished.text == WORDS


async def test_a_reader_that_keeps_up_gets_one_token_per_batch() -> None:
    model = {"stub_reply": WORDS, "stub_tokens_per_second": 200, "enabled": True}
    async with open_pool(stub_settings({"m": model})) as pool, pool.admit(ask("m")) as admission:
        batches = [batch async for batch in admission.batches()]
    # One token per batch (the last one may come with the Finished right behind it).
    assert [sum(isinstance(e, Delta) for e in batch) for batch in batches[:10]] == [1] * 10
    assert sum(len(batch) for batch in batches) == 11
    assert isinstance(batches[-1][-1], Finished)


async def test_a_slow_reader_holds_the_generation_at_the_buffer() -> None:
    reply = " ".join(f"w{i}" for i in range(100))
    settings = stub_settings({"m": {"stub_reply": reply, "enabled": True}}, stream_buffer_tokens=8)
    async with open_pool(settings) as pool:
        async with pool.admit(ask("m")) as admission:
            channel = admission.ticket.receive_channel
            # Backpressure: the sink waits on the full channel instead of piling up.
            await wait_until(lambda: channel.statistics().tasks_waiting_send == 1)
            assert channel.statistics().current_buffer_used == 8
            async with contextlib.aclosing(admission.batches()) as batches:
                first = await anext(batches)
            assert 8 <= len(first) < 12  # the buffer, and what the waiting send held
        # Leaving the block early stops the generation and frees the slot.
        await wait_until(lambda: pool.model("m").replicas[0].inflight == 0)
