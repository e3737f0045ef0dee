"""Plan → execute → apply, the parts that need no model: each role's pure choice of its next step, and
the one `apply_tokens` every role applies a step's tokens with."""

from __future__ import annotations

import pytest
import trio

from messages.commands import RelayedRequest, RelayOffer
from messages.log.events import FirstToken, LogEvent, PrefillFinished
from replicas.decode.work import schedule as decode_schedule
from replicas.model import SamplingParams
from replicas.prefill.queue import PromptQueue
from replicas.prefill.schedule import BatchPlan, Borrow, Candidate, Fresh, Pulled, plan_batch
from replicas.request import FinishedUpdate, RequestSpec, ServingRequest
from replicas.step.apply import apply_tokens, refuse
from replicas.step.plan import Held
from replicas.zigzag.new_prefill import PartBatch
from replicas.zigzag.new_prefill import schedule as part_schedule
from replicas.zigzag.old_prefill import IncomingRelay, plan_relay

BLOCK = 16


def request(name: str, tokens: int, *, max_tokens: int = 8, eos: tuple[int, ...] = ()) -> ServingRequest:
    return ServingRequest(
        RequestSpec.of(
            request_id=name,
            prompt_ids=list(range(1, tokens + 1)),
            images=[],
            sampling=SamplingParams(),
            max_tokens=max_tokens,
        ),
        eos_token_ids=eos,
    )


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def waiting(name: str, tokens: int, *, ready: bool = True) -> Candidate:
    """A queued prompt that has not started and borrows nothing."""
    return Candidate(name, tokens, 0, ready, Fresh())


def plan(candidates: list[Candidate], **budgets: int | None) -> BatchPlan:
    limits: dict[str, int | None] = {"free_blocks": 100, "max_batch_size": 8, "max_batch_tokens": 999}
    limits.update(budgets)
    return plan_batch(
        candidates,
        free_blocks=limits["free_blocks"] or 0,
        block_size=BLOCK,
        max_batch_size=limits["max_batch_size"] or 0,
        max_batch_tokens=limits["max_batch_tokens"] or 0,
        chunk_tokens=limits.get("chunk_tokens"),
    )


def test_the_prefill_batch_is_first_come_first_served_within_the_budgets() -> None:
    queue = PromptQueue()
    for name, tokens in (("a", 30), ("b", 40), ("c", 20), ("d", 10)):
        queue.append(request(name, tokens))
    assert queue.tokens == 100
    candidates = [waiting(r.request_id, r.prompt_tokens) for r in queue]
    chosen = plan(candidates, max_batch_tokens=80)
    assert [line.request_id for line in chosen.lines] == ["a", "b"]  # c would pass 80: no overtaking by d
    chosen = plan(candidates, max_batch_size=3)
    assert [line.request_id for line in chosen.lines] == ["a", "b", "c"]
    # The blocks run out before the second prompt (2 + 3 blocks needed, 4 free).
    chosen = plan(candidates, free_blocks=4)
    assert [(line.request_id, line.allocate, line.takes) for line in chosen.lines] == [("a", 2, 2)]
    assert chosen.blocks == 2


def test_the_prefill_batch_skips_requests_not_ready_and_runs_a_long_prompt_alone() -> None:
    chosen = plan(
        [
            waiting("img", 2, ready=False),
            waiting("gone", 5, ready=False),
            waiting("long", 500),
            waiting("next", 5),
        ],
        free_blocks=1000,
        max_batch_tokens=100,
    )
    assert [(line.request_id, line.start, line.stop, line.last) for line in chosen.lines] == [
        ("long", 0, 500, True)
    ]


def test_a_long_prompt_runs_in_chunks_with_the_others_between() -> None:
    """Chunks of at most `chunk_tokens`; a started prompt holds its blocks (needs none more)."""
    chosen = plan(
        [waiting("long", 100), waiting("short", 10)], free_blocks=7, max_batch_tokens=64, chunk_tokens=40
    )
    assert [(line.request_id, line.start, line.stop, line.last) for line in chosen.lines] == [
        ("long", 0, 40, False)
    ]
    started = Candidate("long", 100, 40, True, None)  # its first chunk ran
    chosen = plan([waiting("short", 10), started], free_blocks=1, max_batch_tokens=64, chunk_tokens=40)
    assert [(line.request_id, line.start, line.stop, line.takes) for line in chosen.lines] == [
        ("short", 0, 10, 1),
        ("long", 40, 80, 0),
    ]
    chosen = plan(
        [Candidate("long", 100, 80, True, None)], free_blocks=0, max_batch_tokens=64, chunk_tokens=40
    )
    assert [(line.start, line.stop, line.last) for line in chosen.lines] == [(80, 100, True)]


def test_a_borrowed_prefix_moves_the_first_chunk_and_costs_only_its_idle_blocks() -> None:
    """A new prompt's chunk starts after its prefix and the token budget counts what it computes; its
    borrowed blocks cost a block each only when nobody referenced them, and once for the whole batch."""
    shared = Borrow(keys=(), blocks=(7, 8, 9), idle=frozenset({8, 9}), counted=True)
    first = Candidate("first", 64, 0, True, shared)  # 4 blocks, 3 borrowed: 1 allocated, 2 idle borrowed
    second = Candidate("second", 64, 0, True, shared)  # the same prefix: its idle blocks counted already
    chosen = plan([first, second], free_blocks=4, max_batch_tokens=32, chunk_tokens=40)
    assert [(line.start, line.stop, line.allocate, line.takes) for line in chosen.lines] == [
        (48, 64, 1, 3),
        (48, 64, 1, 1),
    ]
    # One block fewer: the second does not fit.
    assert [line.request_id for line in plan([first, second], free_blocks=3).lines] == ["first"]
    pulled = Candidate("pulled", 40, 0, True, Pulled((1, 2), "other"))  # holds its 2 blocks already
    assert [(line.start, line.takes) for line in plan([pulled], free_blocks=1).lines] == [(32, 1)]


def test_a_relay_plan_runs_the_live_requests_rows_and_drops_the_others() -> None:
    """`plan_relay` is pure: the requests cancelled or ended while the relay landed are dropped, the
    others keep their rows of the hidden states (all rows: no gather), the layers left follow the
    offer's."""
    first, gone, last = request("first", 3), request("gone", 2), request("last", 4)
    gone.cancel()
    offer = RelayOffer(
        batch_id="b1",
        transfer_id="t1",
        source_endpoint="e",
        new_prefill="np",
        layer=1,
        total_tokens=9,
        requests=[
            RelayedRequest(request_id="first", prompt_tokens=3, offset=0),
            RelayedRequest(request_id="gone", prompt_tokens=2, offset=3),
            RelayedRequest(request_id="last", prompt_tokens=4, offset=5),
        ],
    )
    items = [Held(first, [0]), Held(gone, [1]), Held(last, [2])]
    incoming = IncomingRelay(offer, items)
    plan = plan_relay(incoming, rows=9, num_layers=4)
    assert [item.request.request_id for item in plan.items] == ["first", "last"]
    assert [item.request.request_id for item in plan.dropped] == ["gone"]
    assert plan.starts == (0, 5) and plan.rows == (0, 1, 2, 5, 6, 7, 8) and plan.tokens == 7
    assert plan.layers == range(1, 4)
    assert incoming.items == items and not gone.ended  # nothing touched
    every = plan_relay(
        IncomingRelay(offer, [items[0], Held(request("gone", 2), [1]), items[2]]), rows=9, num_layers=4
    )
    assert every.rows is None and every.tokens == 9  # every row landed is a live request's: no gather


def test_a_decode_step_takes_the_first_running_sequences() -> None:
    running = [Held(request(str(i), 4), [i]) for i in range(5)]
    assert decode_schedule(running, 3) == running[:3]
    assert decode_schedule(running, 8) == running


def part(reached: int, *, computing: bool = False) -> PartBatch:
    return PartBatch(f"b{reached}", [], [], reached=reached, computing=computing)


def test_a_new_prefill_advances_its_oldest_batch_first_then_forms_new_ones() -> None:
    old, young = part(1), part(2)
    # The oldest can run the layers that landed since: it goes first (it is handed over next).
    assert part_schedule([old, young], loaded=2, whole=False, forming=True) == [old]
    # The oldest is computing: a new batch from the queue, else the next batch that can advance.
    busy = part(1, computing=True)
    assert part_schedule([busy, old], loaded=2, whole=False, forming=True) == [None, old]
    assert part_schedule([busy, old], loaded=2, whole=False, forming=False) == [old]
    # Loading finished: a batch that ran every layer still has the head to run.
    done = part(4)
    assert part_schedule([done], loaded=4, whole=True, forming=False) == [done]
    assert part_schedule([done], loaded=4, whole=False, forming=True) == [None]


class Recorder:
    def __init__(self) -> None:
        self.events: list[LogEvent] = []

    def emit(self, event: LogEvent) -> None:
        self.events.append(event)

    def bind(self, *, request_id: str | None = None, replica: str | None = None) -> Recorder:
        return self


def test_apply_tokens_appends_streams_ends_and_frees_for_every_role() -> None:
    going = request("going", 4, max_tokens=3)
    stopping = request("stopping", 4, eos=(7,))
    full = request("full", 4, max_tokens=1)
    cancelled = request("cancelled", 4)
    cancelled.cancel()
    long = request("long", 10)  # its KV and the next token: 10 + 1 > a context of 10
    items = [Held(r, [i]) for i, r in enumerate((going, stopping, full, cancelled, long))]
    freed: list[str] = []
    log = Recorder()
    going_on = apply_tokens(
        items,
        [5, 7, 5, 5, 5],
        context_length=10,
        release=lambda item: freed.append(item.request.request_id),
        log=log,
        first=True,
    )
    assert [item.request.request_id for item in going_on] == ["going"]
    assert freed == ["stopping", "full", "cancelled", "long"]
    assert going.generated == [5] and not going.ended
    assert [(r.request_id, r.final_update) for r in (stopping, full, cancelled, long)] == [
        ("stopping", FinishedUpdate("stop")),
        ("full", FinishedUpdate("length")),
        ("cancelled", FinishedUpdate("cancelled")),
        ("long", FinishedUpdate("length")),
    ]
    assert cancelled.generated == []  # no token for a request cancelled meanwhile
    assert sum(isinstance(e, PrefillFinished) for e in log.events) == 5  # first tokens: a prefill's end
    assert sum(isinstance(e, FirstToken) for e in log.events) == 4


@pytest.mark.parametrize("cancel_wins", [False, True])
def test_refuse_frees_and_fails_every_request(cancel_wins: bool) -> None:
    live, cancelled = request("live", 4), request("cancelled", 4)
    cancelled.cancel()
    freed: list[str] = []
    refuse(
        [Held(live, [0]), Held(cancelled, [1])],
        code="bad_request",
        message="token id 9999 is outside the vocabulary",
        release=lambda item: freed.append(item.request.request_id),
        cancel_wins=cancel_wins,
    )
    assert freed == ["live", "cancelled"]
    assert live.final_update is not None and live.final_update.code == "bad_request"  # type: ignore[union-attr]
    assert isinstance(cancelled.final_update, FinishedUpdate) == cancel_wins


async def test_compute_runs_one_call_at_a_time_and_applies_in_the_loop() -> None:
    """`Compute` (replicas.step.compute): the result comes back through the actor's `later`."""
    from replicas.emulation import EmulatedSpeed
    from replicas.model import TINY_CONFIG, ContextLengthError
    from replicas.step.compute import Compute

    applied: list[object] = []

    class Actor:
        name, log, state = "r-0", Recorder(), None

        def __init__(self, nursery: trio.Nursery) -> None:
            self.nursery = nursery

        def post(self, item: object = None) -> None:
            raise AssertionError("not used")

        def later(self, apply: object) -> None:
            assert callable(apply)
            apply()

        def spawn(self, fn: object, *args: object) -> None:
            self.nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        compute = Compute(Actor(nursery), TINY_CONFIG, EmulatedSpeed())  # type: ignore[arg-type]
        compute.run(lambda: 41 + 1, applied.append, applied.append)
        assert compute.busy
        with pytest.raises(AssertionError, match="a compute is already running"):
            compute.run(lambda: 0, applied.append, applied.append)
    assert applied == [42] and not compute.busy

    def refused() -> int:
        raise ContextLengthError("too long")

    async with trio.open_nursery() as nursery:
        compute = Compute(Actor(nursery), TINY_CONFIG, EmulatedSpeed())  # type: ignore[arg-type]
        compute.run(refused, applied.append, lambda error: applied.append(str(error)))
    assert applied == [42, "too long"]
