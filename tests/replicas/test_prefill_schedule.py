"""The pure prefill scheduler (`replicas.prefill.schedule.plan_batch`) and its invariants (hypothesis):
it never plans more blocks than the pool gives, counts a borrowed prefix once, cuts chunks that cover
each prompt exactly, keeps within its budgets, and never lets a request overtake one that does not fit;
planned against a real prefix cache and block pool, executing the plan borrows and allocates exactly
what it counted."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from replicas.prefill.schedule import Borrow, Candidate, Fresh, Prefix, Pulled, plan_batch, prefix_blocks
from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import PrefixCache, block_keys

MODEL = b"test-model"


@st.composite
def candidates(draw: st.DrawFn, block_size: int) -> Candidate:
    """A queued request: started (holds its blocks), or new with no prefix, a cached one (its blocks
    drawn from a small set, so prompts share them) or a pulled one."""
    tokens = draw(st.integers(1, 120))
    name = f"r{draw(st.integers(0, 10**9))}"
    ready = draw(st.booleans() | st.just(True))
    most = (tokens - 1) // block_size  # a prefix leaves the prompt's last token to run
    kind = draw(st.sampled_from(["started", "fresh", "borrow", "pulled"]))
    if kind == "started" and tokens > 1:
        return Candidate(name, tokens, draw(st.integers(1, tokens - 1)), ready, None)
    prefix: Prefix = Fresh()
    if kind == "borrow":
        count = draw(st.integers(0, most))
        blocks = tuple(range(count))  # one chain: prompts borrowing share its leading blocks
        idle = frozenset(draw(st.sets(st.sampled_from(blocks)))) if blocks else frozenset()
        prefix = Borrow(keys=(), blocks=blocks, idle=idle, counted=True)
    elif kind == "pulled":
        count = draw(st.integers(0, most))
        prefix = Pulled(tuple(range(1000, 1000 + count)), "other")
    return Candidate(name, tokens, 0, ready, prefix)


@st.composite
def queues(draw: st.DrawFn) -> tuple[int, list[Candidate]]:
    block_size = draw(st.sampled_from([1, 4, 16]))
    queue = draw(st.lists(candidates(block_size), max_size=12, unique_by=lambda c: c.request_id))
    return block_size, queue


budgets = {
    "free_blocks": st.integers(0, 40),
    "max_batch_size": st.integers(1, 8),
    "max_batch_tokens": st.integers(1, 200),
    "chunk_tokens": st.none() | st.integers(1, 64),
}


@given(queues(), st.fixed_dictionaries(budgets))
def test_a_plan_keeps_within_its_blocks_and_budgets_counting_a_prefix_once(
    drawn: tuple[int, list[Candidate]], limits: dict[str, int | None]
) -> None:
    block_size, queue = drawn
    free, chunk = limits["free_blocks"], limits["chunk_tokens"]
    size, budget = limits["max_batch_size"], limits["max_batch_tokens"]
    assert free is not None and size is not None and budget is not None
    plan = plan_batch(
        queue,
        free_blocks=free,
        block_size=block_size,
        max_batch_size=size,
        max_batch_tokens=budget,
        chunk_tokens=chunk,
    )
    # Never more blocks than free; each borrowed idle block counted once, for the batch as a whole.
    assert plan.blocks <= free
    idle: set[int] = set()
    for line in plan.lines:
        if isinstance(line.prefix, Borrow):
            idle |= line.prefix.idle
    assert plan.blocks == sum(line.allocate for line in plan.lines) + len(idle)
    # The budgets: sequences, and tokens unless the batch is one piece that runs alone.
    assert len(plan) <= size
    assert plan.tokens <= budget or len(plan) == 1
    # First come, first served: the plan is the head of the ready queue, in order.
    ready = [c for c in queue if c.ready]
    assert [line.request_id for line in plan.lines] == [c.request_id for c in ready[: len(plan)]]
    by_id = {c.request_id: c for c in ready}
    for line in plan.lines:
        candidate = by_id[line.request_id]
        # The chunk starts where the prompt stands — after a new prompt's prefix — and stays within it.
        if candidate.prefix is None:
            assert line.start == candidate.prefilled and line.allocate == 0 and line.takes == 0
        else:
            held = len(prefix_blocks(candidate.prefix))
            assert line.start == held * block_size
            assert line.allocate == -(-candidate.prompt_tokens // block_size) - held >= 1
        assert line.start < line.stop <= candidate.prompt_tokens
        assert line.tokens == (
            candidate.prompt_tokens - line.start
            if chunk is None
            else min(chunk, candidate.prompt_tokens - line.start)
        )
    # The first ready request left out did not fit: no overtaking it.
    if len(plan) < len(ready):
        left = ready[len(plan)]
        start = left.prefilled if left.prefix is None else len(prefix_blocks(left.prefix)) * block_size
        piece = left.prompt_tokens - start if chunk is None else min(chunk, left.prompt_tokens - start)
        takes = 0
        if left.prefix is not None:
            takes = -(-left.prompt_tokens // block_size) - len(prefix_blocks(left.prefix))
            if isinstance(left.prefix, Borrow):
                takes += len(left.prefix.idle - idle)
        full = bool(plan) and (len(plan) >= size or plan.tokens + piece > budget)
        assert full or takes > free - plan.blocks


@given(
    tokens=st.integers(1, 300),
    held=st.integers(0, 40),
    block_size=st.sampled_from([1, 4, 16]),
    chunk=st.integers(1, 64),
)
def test_chunks_cover_the_prompt_exactly(tokens: int, held: int, block_size: int, chunk: int) -> None:
    """Planned batch after batch, a prompt's chunks tile `[prefix, prompt)` with no gap or overlap, the
    first after its prefix, only the last ending it."""
    held = min(held, (tokens - 1) // block_size)
    prefix = Borrow(keys=(), blocks=tuple(range(held)), idle=frozenset(), counted=True)
    candidate = Candidate("r", tokens, 0, True, prefix)
    pieces: list[tuple[int, int, bool]] = []
    while True:
        plan = plan_batch(
            [candidate],
            free_blocks=1000,
            block_size=block_size,
            max_batch_size=1,
            max_batch_tokens=chunk,
            chunk_tokens=chunk,
        )
        (line,) = plan.lines
        pieces.append((line.start, line.stop, line.last))
        if line.last:
            break
        candidate = Candidate("r", tokens, line.stop, True, None)  # its chunk ran: queued again, started
    assert pieces[0][0] == held * block_size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert pieces[-1][1] == tokens
    assert [last for _, _, last in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(0 < stop - start <= chunk for start, stop, _ in pieces)


prompts = st.lists(st.integers(1, 3), min_size=1, max_size=14)  # few token values: prefixes overlap


@given(
    past=st.lists(prompts, max_size=6),
    running=st.lists(prompts, max_size=3),
    queued=st.lists(prompts, min_size=1, max_size=8),
    blocks=st.integers(4, 40),
    chunk=st.none() | st.integers(1, 8),
    budget=st.integers(1, 40),
)
def test_executing_a_plan_against_the_real_cache_takes_exactly_what_it_counted(
    past: list[list[int]],
    running: list[list[int]],
    queued: list[list[int]],
    blocks: int,
    chunk: int | None,
    budget: int,
) -> None:
    """A cache holding computed prompts (unreferenced) and running ones (referenced); the queue's
    prefixes looked up with `peek`. Borrowing every planned prefix, then allocating every line, never
    fails — eviction to make room never takes a planned prefix — and the pool's available count drops by
    exactly the blocks the plan counted."""
    block_size = 2
    pool = BlockPool(blocks, block_size)
    cache = PrefixCache(pool)

    def start(owner: str, tokens: list[int]) -> list[int] | None:
        keys = block_keys(MODEL, tokens, block_size)
        borrowed = cache.acquire(owner, keys, limit=(len(tokens) - 1) // block_size)
        rest = pool.try_allocate(pool.blocks_for(len(tokens)) - len(borrowed), owner)
        if rest is None:
            cache.release(owner, borrowed)
            return None
        cache.publish(owner, borrowed + rest)
        return borrowed + rest

    for index, tokens in enumerate(past):
        table = start(f"past{index}", tokens)
        if table is not None:
            cache.release(f"past{index}", table)
    for index, tokens in enumerate(running):
        start(f"run{index}", tokens)  # stays: its blocks referenced
    queue: list[Candidate] = []
    for index, tokens in enumerate(queued):
        keys = block_keys(MODEL, tokens, block_size)
        found, idle = cache.peek(keys, limit=(len(tokens) - 1) // block_size)
        borrow = Borrow(keys=tuple(keys), blocks=tuple(found), idle=frozenset(idle), counted=True)
        queue.append(Candidate(f"q{index}", len(tokens), 0, True, borrow))
    available = pool.allocatable_blocks
    plan = plan_batch(
        queue,
        free_blocks=available,
        block_size=block_size,
        max_batch_size=8,
        max_batch_tokens=budget,
        chunk_tokens=chunk,
    )
    for line in plan.lines:  # every prefix first, as `PrefillWork.execute` does
        assert isinstance(line.prefix, Borrow)
        got = cache.acquire(line.request_id, line.prefix.keys, limit=len(line.prefix.blocks))
        assert tuple(got) == line.prefix.blocks
    for line in plan.lines:
        assert pool.try_allocate(line.allocate, line.request_id) is not None
    assert pool.allocatable_blocks == available - plan.blocks
    cache.check_invariants()
    pool.check_invariants()
