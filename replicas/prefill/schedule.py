"""The pure choice of a prefill replica's next batch: a `BatchPlan`, decided from values.

`plan_batch` reads `Candidate`s — what each queued request is now, its cached or pulled prefix looked up
and nothing borrowed — and decides, without touching anything, which requests run, which tokens of
each (`Line.start`, `Line.stop`), which prefix each new prompt starts with (borrowed from the prefix
cache, or the blocks its pull left it holding) and how many blocks each allocates. Executing the plan
(`replicas.prefill.work.PrefillWork.execute`) only borrows, allocates and runs what it says; it never
decides again.

The choice: ready requests first come first served, until `max_batch_size` sequences or
`max_batch_tokens` prompt tokens to compute (a longer piece runs alone) or the blocks the pool can give
(`free_blocks`) run out; requests not ready (their embeddings or pulled prefix still landing, or
cancelled) are skipped, and a request that does not fit is not overtaken.

A new prompt's cost in blocks: the blocks it allocates (its prompt's, less its prefix) plus the borrowed
cached blocks nobody referenced before it (`Borrow.idle`: they counted as available, the pool could
have reclaimed them; borrowed, they no longer are). A block several prompts of the batch borrow counts
once, for the first; a block a running request already references counts for none. Blocks a pull left
that the batch gives back (`Fresh.drop`) are not credited (the plan stays within what is free before
it). A prompt whose first chunks ran (`Candidate.prefix` None) holds its blocks already.

Chunked prefill (`chunk_tokens`): a prompt longer than that runs as pieces of at most `chunk_tokens`
tokens, one per batch, from where it stands — a new prompt after its prefix, a started one after what
ran (`Candidate.prefilled`); the token budget counts the tokens computed, not the prefix.

Invariants (hypothesis tests): a plan never takes more blocks than `free_blocks`; a block borrowed by
several lines is counted once; each line's chunk lies within its prompt and a new prompt's starts right
after its prefix; the plan keeps within `max_batch_size` and within `max_batch_tokens` unless it is one
line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import assert_never, final


@final
class PlanBroken(Exception):
    """Executing a plan found the prefix cache or the pool other than the plan saw them (the plan is
    made and executed in one step of the main loop, nothing between: only a bug gets here)."""


@final
@dataclass(frozen=True, slots=True)
class Borrow:
    """A new prompt borrows `blocks`, the cached blocks of its leading `keys` (`PrefixCache.acquire`
    under the request's id; empty `blocks`: the borrowing only remembers the keys, so its computed blocks
    join the cache later); `idle`: those of `blocks` no request references now. `counted`: the lookup
    counts in the cache's hit rate (not for a prompt whose every row must run, to score its tokens)."""

    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]
    idle: frozenset[int]
    counted: bool


@final
@dataclass(frozen=True, slots=True)
class Pulled:
    """A new prompt starts with `blocks` its pull left it holding (borrowed and landed: already its own),
    pulled from `source` (None: nothing landed, they are this replica's own)."""

    blocks: tuple[int, ...]
    source: str | None


@final
@dataclass(frozen=True, slots=True)
class Fresh:
    """A new prompt that starts from its first token (a ZigZag batch borrows nothing: its layers run in
    two places); `drop`: blocks its pull left it holding, given back first."""

    drop: tuple[int, ...] = ()


Prefix = Borrow | Pulled | Fresh


def prefix_blocks(prefix: Prefix) -> tuple[int, ...]:
    """The blocks a new prompt's table starts with."""
    match prefix:
        case Borrow(blocks=blocks) | Pulled(blocks=blocks):
            return blocks
        case Fresh():
            return ()
        case _:
            assert_never(prefix)


@final
@dataclass(frozen=True, slots=True)
class Candidate:
    """A queued request as the plan sees it. `ready`: laid out, not cancelled, no pull landing;
    `prefix` None: its first chunks ran here (it holds its blocks, `prefilled` tokens of them computed)."""

    request_id: str
    prompt_tokens: int
    prefilled: int
    ready: bool
    prefix: Prefix | None


@final
@dataclass(frozen=True, slots=True)
class Line:
    """One request's part of a batch: prompt tokens `[start, stop)`; `prefix` (new prompts): what its
    table starts with; `allocate`: blocks to allocate for it; `takes`: blocks it takes out of the
    available count (`allocate` plus its borrowed idle blocks no earlier line counted)."""

    request_id: str
    prompt_tokens: int
    start: int
    stop: int
    prefix: Prefix | None
    allocate: int
    takes: int

    @property
    def tokens(self) -> int:
        return self.stop - self.start

    @property
    def last(self) -> bool:
        """The chunk ends the prompt (it samples the first token)."""
        return self.stop == self.prompt_tokens


@final
@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The next batch, line by line in queue order; empty: nothing runs."""

    lines: tuple[Line, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def tokens(self) -> int:
        """The prompt tokens the batch computes."""
        return sum(line.tokens for line in self.lines)

    @property
    def blocks(self) -> int:
        """The blocks the batch takes out of the available count."""
        return sum(line.takes for line in self.lines)


def plan_batch(
    candidates: Iterable[Candidate],
    *,
    free_blocks: int,
    block_size: int,
    max_batch_size: int,
    max_batch_tokens: int,
    chunk_tokens: int | None = None,
) -> BatchPlan:
    """The next batch (see the module docstring). `candidates` in queue order, read only as far as the
    batch reaches (a lazy iterable looks up no further prefix). `chunk_tokens` None: whole prompts."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lines: list[Line] = []
    tokens = 0
    counted: set[int] = set()  # idle blocks an earlier line borrows
    queue = iter(candidates)
    while not lines or len(lines) < max_batch_size:  # a full batch reads (looks up) no further
        candidate = next(queue, None)
        if candidate is None:
            break
        if not candidate.ready:
            continue
        prefix = candidate.prefix
        start = candidate.prefilled if prefix is None else len(prefix_blocks(prefix)) * block_size
        left = candidate.prompt_tokens - start
        piece = left if chunk_tokens is None else min(left, chunk_tokens)
        if lines and tokens + piece > max_batch_tokens:
            break
        allocate = takes = 0
        idle: frozenset[int] = frozenset()
        if prefix is not None:
            allocate = -(-candidate.prompt_tokens // block_size) - len(prefix_blocks(prefix))
            if isinstance(prefix, Borrow):
                idle = prefix.idle - counted
            takes = allocate + len(idle)
        if takes > free_blocks:
            break  # first come, first served: no overtaking the one that does not fit
        lines.append(
            Line(candidate.request_id, candidate.prompt_tokens, start, start + piece, prefix, allocate, takes)
        )
        tokens += piece
        free_blocks -= takes
        counted |= idle
    return BatchPlan(tuple(lines))
