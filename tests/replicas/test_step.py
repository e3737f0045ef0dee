"""Plan → execute → apply, the parts that need no model: each role's pure choice of its next step, and
the one `apply_tokens` every role applies a step's tokens with."""

from __future__ import annotations

import pytest
import torch
import trio

from messages.log.events import FirstToken, LogEvent, PrefillFinished
from replicas.decode.work import schedule as decode_schedule
from replicas.model import SamplingParams
from replicas.prefill.queue import PromptQueue
from replicas.prefill.queue import schedule as prefill_schedule
from replicas.request import FinishedUpdate, RequestSpec, ServingRequest
from replicas.step.apply import apply_tokens, refuse
from replicas.step.plan import Held
from replicas.zigzag.new_prefill import PartBatch
from replicas.zigzag.new_prefill import schedule as part_schedule

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


def test_the_prefill_batch_is_first_come_first_served_within_the_budgets() -> None:
    queue = PromptQueue()
    for name, tokens in (("a", 30), ("b", 40), ("c", 20), ("d", 10)):
        queue.append(request(name, tokens))
    assert queue.tokens == 100
    plan = prefill_schedule(
        queue, free_blocks=100, blocks_for=blocks_for, max_batch_size=8, max_batch_tokens=80
    )
    assert [c.request.request_id for c in plan] == ["a", "b"]  # c would pass 80 tokens: no overtaking by d
    plan = prefill_schedule(
        queue, free_blocks=100, blocks_for=blocks_for, max_batch_size=3, max_batch_tokens=999
    )
    assert [c.request.request_id for c in plan] == ["a", "b", "c"]
    # The blocks run out before the second prompt (2 + 3 blocks needed, 4 free).
    plan = prefill_schedule(
        queue, free_blocks=4, blocks_for=blocks_for, max_batch_size=8, max_batch_tokens=999
    )
    assert [c.request.request_id for c in plan] == ["a"]
    assert len(queue) == 4  # pure: nothing was taken


def test_the_prefill_batch_skips_requests_not_ready_and_runs_a_long_prompt_alone() -> None:
    waiting = ServingRequest(
        RequestSpec.of(
            request_id="img",
            prompt_ids=[1, 2],
            images=[torch.zeros(16, 16, 3, dtype=torch.uint8).numpy()],
            sampling=SamplingParams(),
            max_tokens=4,
        ),
        eos_token_ids=(),
    )
    cancelled = request("gone", 5)
    cancelled.cancel()
    long = request("long", 500)
    plan = prefill_schedule(
        [waiting, cancelled, long, request("next", 5)],
        free_blocks=1000,
        blocks_for=blocks_for,
        max_batch_size=8,
        max_batch_tokens=100,
    )
    assert [(c.request.request_id, c.start, c.stop, c.last) for c in plan] == [("long", 0, 500, True)]


def test_a_long_prompt_runs_in_chunks_with_the_others_between() -> None:
    """Chunks of at most `chunk_tokens`; a started prompt holds its blocks (needs none more) and, queued
    again at the back, lets the requests that came meanwhile go first."""
    queue = PromptQueue()
    long, short = request("long", 100), request("short", 10)
    queue.append(long)
    queue.append(short)
    plan = prefill_schedule(
        queue, free_blocks=7, blocks_for=blocks_for, max_batch_size=8, max_batch_tokens=64, chunk_tokens=40
    )
    assert [(c.request.request_id, c.start, c.stop, c.last) for c in plan] == [("long", 0, 40, False)]
    long.prefilled = 40  # its first chunk ran: queued again behind `short`
    queue.remove(long)
    queue.append(long)
    assert queue.tokens == 10 + 60
    plan = prefill_schedule(
        queue, free_blocks=1, blocks_for=blocks_for, max_batch_size=8, max_batch_tokens=64, chunk_tokens=40
    )
    assert [(c.request.request_id, c.start, c.stop) for c in plan] == [("short", 0, 10), ("long", 40, 80)]
    long.prefilled = 80
    plan = prefill_schedule(
        [long], free_blocks=0, blocks_for=blocks_for, max_batch_size=8, max_batch_tokens=64, chunk_tokens=40
    )
    assert [(c.start, c.stop, c.last) for c in plan] == [(80, 100, True)]


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
