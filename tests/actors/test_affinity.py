"""Prefix affinity: a conversation's next turn goes to the replica that served its
prompt, within its cache scope, and never waits for it."""

from __future__ import annotations

from pool.actors.models._affinity import (
    BLOCK_CHARS,
    PrefixSummary,
    RecentPrompts,
    longest_held,
    prefix_keys,
)
from pool.actors.models._scheduler import Scheduler
from pool.actors.models._ticket import Ticket
from pool.backends import CacheScope, Decoding, GenerationRequest, TextPart, Turn

SYSTEM = "You are a careful assistant. " * 40  # two whole blocks shared by every prompt


class _Replica:
    def __init__(self, name: str, capacity: int = 4) -> None:
        self.name = name
        self.capacity = capacity
        self.inflight = 0
        self.started: list[Ticket] = []

    def start_job(self, ticket: Ticket) -> None:
        self.inflight += 1
        self.started.append(ticket)

    def finish(self, scheduler: Scheduler, reply: str = "") -> None:
        """End the oldest running job, as a replica does: ``reply`` was its answer."""
        ticket = self.started[-self.inflight]
        if ticket.reply is not None and reply:
            ticket.reply.add(reply)
            ticket.reply.finish()
        self.inflight -= 1
        scheduler.job_finished()


def _request(*texts: str, tenant: str = "default", tag: str | None = None,
             cached: bool = True, rid: str = "r",
             instructions: str = SYSTEM) -> GenerationRequest:  # fmt: skip
    turns = tuple(
        Turn("user" if i % 2 == 0 else "assistant", (TextPart(t),)) for i, t in enumerate(texts)
    )
    return GenerationRequest(
        request_id=rid,
        model="m",
        turns=turns,
        decoding=Decoding(),
        instructions=instructions,
        multi_turn=len(turns) > 1,
        cache=CacheScope(tenant=tenant, tag=tag, enabled=cached),
    )


REPLICAS: list[_Replica] = []


def _send(scheduler: Scheduler, request: GenerationRequest) -> str:
    """Dispatch ``request``: the name of the replica it started on."""
    ticket = Ticket(request, tenant=request.cache.tenant)
    scheduler.enqueue(ticket)
    return next(r.name for r in REPLICAS if r.started and r.started[-1] is ticket)


def _conversation(n: int) -> list[str]:
    """User and assistant turns, alternately (the assistant's are the replies). Longer
    than the shared instructions: a first turn holds less than half of its prompt on any
    replica (so it is balanced); a later one, with the reply recorded, more than half on
    its own."""
    return [f"conversation {n} turn {i}: " + "words " * 200 for i in range(11)]


def test_keys_name_whole_prefixes_within_a_scope() -> None:
    one = prefix_keys(_request("hello " * 200))
    longer = prefix_keys(_request("hello " * 200, "an answer " * 80, "and more " * 90))
    assert len(one) >= len(SYSTEM + "hello " * 200) // BLOCK_CHARS  # whole blocks only
    assert longer[: len(one)] == one
    assert prefix_keys(_request("hello " * 200, tenant="b"))[0] != one[0]
    assert prefix_keys(_request("hello " * 200, tag="t"))[0] != one[0]
    assert prefix_keys(_request("hello " * 200, cached=False)) == ()
    assert prefix_keys(_request("hi")) == prefix_keys(_request("hi"))  # no per-process salt


def test_a_summary_matches_the_longest_held_prefix_and_stays_bounded() -> None:
    summary = PrefixSummary(capacity=10)
    keys = prefix_keys(_request("x " * 3000))
    assert len(keys) > 10
    summary.record(keys)
    assert len(summary) == 10
    assert summary.match(keys) == 10  # the tail went first: the first ten are held
    # Another prompt shares the instructions' whole blocks, and no more.
    assert summary.match(prefix_keys(_request("y " * 3000))) == len(SYSTEM) // BLOCK_CHARS
    summary.clear()
    assert summary.match(keys) == 0


async def test_each_conversation_returns_to_its_replica() -> None:
    scheduler = Scheduler(max_queue=10)
    replicas = [_Replica("a"), _Replica("b"), _Replica("c")]
    scheduler.set_replicas(replicas)
    REPLICAS[:] = replicas
    homes: dict[int, str] = {}
    conversations = {n: _conversation(n) for n in range(6)}
    for turn in range(5):
        for n, texts in conversations.items():
            went = _send(scheduler, _request(*texts[: 2 * turn + 1]))
            homes.setdefault(n, went)
            assert went == homes[n], (n, turn)
            # The answer is the conversation's next assistant turn.
            next(r for r in replicas if r.name == went).finish(scheduler, texts[2 * turn + 1])
    # The first turns spread over the replicas (least loaded, then least filled).
    assert sorted(homes.values()) == ["a", "a", "b", "b", "c", "c"]


def test_without_the_recorded_reply_a_long_answer_loses_the_way() -> None:
    # What the reply recording is for: the prompt alone is under half of the next turn's.
    texts = _conversation(0)
    summary = PrefixSummary()
    summary.record(prefix_keys(_request(*texts[:1])))
    assert (
        summary.match(prefix_keys(_request(*texts[:3])))
        < len(prefix_keys(_request(*texts[:3]))) / 2
    )
    summary.record(prefix_keys(_request(*texts[:1]), reply=texts[1]))
    assert (
        summary.match(prefix_keys(_request(*texts[:3])))
        > len(prefix_keys(_request(*texts[:3]))) / 2
    )


async def test_affinity_never_makes_a_request_wait() -> None:
    scheduler = Scheduler(max_queue=10)
    a, b = _Replica("a", capacity=1), _Replica("b", capacity=1)
    scheduler.set_replicas([a, b])
    REPLICAS[:] = [a, b]
    texts = _conversation(0)
    assert _send(scheduler, _request(*texts[:1])) == "a"
    # a is busy: the next turn goes to free b at once rather than waiting for a.
    assert _send(scheduler, _request(*texts[:3])) == "b"
    assert scheduler.queue_depth == 0


async def test_one_tenant_prefix_never_attracts_another() -> None:
    scheduler = Scheduler(max_queue=10)
    replicas = [_Replica("a"), _Replica("b")]
    scheduler.set_replicas(replicas)
    REPLICAS[:] = replicas
    texts = _conversation(0)
    assert _send(scheduler, _request(*texts[:1], tenant="t1")) == "a"
    # Same text, another tenant: no match, so the least loaded (b, as a still runs t1).
    assert _send(scheduler, _request(*texts[:1], tenant="t2")) == "b"
    replicas[0].finish(scheduler, texts[1])
    replicas[1].finish(scheduler, texts[1])
    # With both free and idle, each tenant's next turn goes back to its own replica.
    assert _send(scheduler, _request(*texts[:3], tenant="t2")) == "b"
    replicas[1].finish(scheduler)
    assert _send(scheduler, _request(*texts[:3], tenant="t1")) == "a"


async def test_off_or_flushed_means_least_loaded() -> None:
    for mode in ("on", "off", "flushed"):
        scheduler = Scheduler(max_queue=10, affinity=mode != "off")
        a, b = _Replica("a"), _Replica("b")
        scheduler.set_replicas([a, b])
        REPLICAS[:] = [a, b]
        texts = _conversation(0)
        assert _send(scheduler, _request(*texts[:1])) == "a"
        a.finish(scheduler, texts[1])
        a.inflight += 1  # another request runs on a: it has free slots, but is busier
        if mode == "flushed":
            scheduler.forget_prefixes()
        # a runs one request, b none: affinity picks a (it holds the conversation),
        # least loaded picks b.
        expected = "a" if mode == "on" else "b"
        assert _send(scheduler, _request(*texts[:3])) == expected, mode


def test_recent_prompts_name_each_conversation_once_newest_first_within_the_cap() -> None:
    changes: list[None] = []
    recent = RecentPrompts(2, on_change=lambda: changes.append(None))
    chats = {n: _conversation(n) for n in range(3)}
    for n in (0, 1):
        recent.record(prefix_keys(_request(chats[n][0])))
        recent.record(prefix_keys(_request(chats[n][0]), reply=chats[n][1]))
    # The answer's key stands for the prompt's too: one key per conversation.
    assert len(recent) == 2
    second_turn = prefix_keys(_request(*chats[0][:3]))
    assert longest_held(second_turn, set(recent.newest())) > len(second_turn) / 2
    recent.record(prefix_keys(_request(chats[2][0]), reply=chats[2][1]))
    # Conversation 2 is the newest; conversation 0, the oldest, is gone.
    assert recent.newest()[0] == prefix_keys(_request(chats[2][0]), reply=chats[2][1])[-1]
    assert longest_held(second_turn, set(recent.newest())) == 0
    assert len(recent) == 2
    # Another tenant's copy of conversation 1 matches nothing of it.
    other = prefix_keys(_request(*chats[1][:3], tenant="t2"))
    assert longest_held(other, set(recent.newest())) == 0
    assert longest_held(prefix_keys(_request(*chats[1][:3])), set(recent.newest())) > 0
    told = len(changes)
    recent.clear()
    assert (len(recent), len(changes)) == (0, told + 1)


async def test_in_a_cluster_one_replica_tells_its_prompts_hashed_once() -> None:
    for cluster in (False, True):
        scheduler = Scheduler(max_queue=10, recent_prompts=8 if cluster else 0)
        only = _Replica("a", capacity=1)
        scheduler.set_replicas([only])
        REPLICAS[:] = [only]
        assert scheduler.next_position == 0
        texts = _conversation(0)
        # Keys the router hashed already: the scheduler keeps them as they are.
        ticket = Ticket(_request(*texts[:1]), tenant="default")
        hashed = prefix_keys(ticket.request)  # type: ignore[arg-type]
        ticket.prefix_keys = hashed
        scheduler.enqueue(ticket)
        assert ticket.prefix_keys is hashed
        recent = scheduler.recent_prompts
        if not cluster:
            # One replica, no cluster: nothing is remembered (or answered into).
            assert recent is None and ticket.reply is None
            continue
        assert recent is not None and recent.newest() == [hashed[-1]]
        assert scheduler.prefix_held(hashed) == len(hashed)
        # Its one slot is taken: a request now would be first in line, then second.
        assert scheduler.next_position == 1
        scheduler.enqueue(Ticket(_request("another"), tenant="default"))
        assert scheduler.next_position == 2
        scheduler.set_replicas(())
        assert recent.newest() == []  # unloaded: nothing is cached any more


async def test_a_first_turn_shorter_than_a_block_still_draws_the_next() -> None:
    scheduler = Scheduler(max_queue=10)
    replicas = [_Replica("a"), _Replica("b")]
    scheduler.set_replicas(replicas)
    REPLICAS[:] = replicas
    question, answer = "hello " * 20, "an answer of some length " * 20
    assert prefix_keys(_request(question, instructions="")) == ()
    assert _send(scheduler, _request(question, instructions="")) == "a"
    replicas[0].finish(scheduler, answer)  # the prompt and its answer fill a block
    replicas[0].inflight += 1  # a is busier than b now, but holds the conversation
    assert _send(scheduler, _request(question, answer, "and?", instructions="")) == "a"
