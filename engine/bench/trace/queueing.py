"""A queueing model of one node's prefill replicas: when does each prompt's first token come?

`first_tokens(trace, counts, ReplicaModel(...))` plays the trace's arrivals, in order, on a number of
prefill replicas that may change over time (`counts`: a step function `[(from_s, replicas), ...]`, the
first from 0), the way the node serves them:

- one first-come, first-served queue in front of every replica (the router hands a prompt to the first
  replica free — what the node does since no prompt waits in front of an idle replica);
- a free replica takes a batch from the queue's head: whole prompts while their tokens fit
  `max_batch_tokens`, at least one (a prompt longer than the budget runs alone, as the node runs it);
- a batch takes `overhead_s + tokens / tokens_per_s` (the emulated accelerator's speed, plus a fixed cost
  per batch on its replica), and each of its prompts has its first token when the batch ends;
- before that, every batch holds the node's one host for `host_s` (the event loop and the cores every
  replica shares, a batch at a time): a batch starts on the host once it is free, and runs on its
  replica after — so past some count more replicas stop helping, which the measured static probes
  show and a per-replica cost cannot;
- a replica removed from the count finishes its batch first; one added serves from its start.

Decode, the KV transfer and the first token's trip to the client are not in it (the trace bench's TTFT
is the node's `timings.ttft_s`, in which they are small against the queue); the model is judged in every
trace run against static provisioning's measured attainment at the same count.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.slo import Slo


@final
@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """One prefill replica: its emulated speed, the most prompt tokens a batch takes, a cost per batch on
    the replica (`overhead_s`) and on the node's shared host (`host_s`, one batch at a time)."""

    tokens_per_s: float
    max_batch_tokens: int = 512
    overhead_s: float = 0.0
    host_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0 or self.max_batch_tokens < 1 or self.overhead_s < 0 or self.host_s < 0:
            raise ValueError(f"a replica model needs a positive speed and batch budget: {self}")

    def batch_seconds(self, tokens: int) -> float:
        return self.overhead_s + tokens / self.tokens_per_s


def count_at(counts: Sequence[tuple[float, int]], at: float) -> int:
    """The replicas of the step function `counts` at time `at` (the last step starting at or before it)."""
    return counts[max(0, bisect.bisect_right([start for start, _ in counts], at) - 1)][1]


def first_tokens(
    trace: Sequence[TraceRequest], counts: Sequence[tuple[float, int]], replica: ReplicaModel
) -> list[float]:
    """Each request's TTFT (seconds), in the order of `trace` (sorted by arrival), under the model of the
    module docstring. `counts` must start at 0 and give at least one replica at every step."""
    if not counts or counts[0][0] != 0.0 or any(n < 1 for _, n in counts):
        raise ValueError("counts must start at 0 s with at least one replica at every step")
    if any(b[0] <= a[0] for a, b in itertools.pairwise(counts)):
        raise ValueError("counts must be in increasing order of time")
    if any(b.at < a.at for a, b in itertools.pairwise(trace)):
        raise ValueError("the trace must be sorted by arrival")
    ttft = [0.0] * len(trace)
    queue: deque[int] = deque()
    busy: list[float] = []  # heap of the times the running batches end
    starts = [start for start, _ in counts]
    now = 0.0
    arrived = 0
    step = 0  # counts[step] holds at `now`
    host_free = 0.0  # when the node's host is free for the next batch

    def start_batches() -> None:
        nonlocal host_free
        while queue and len(busy) < counts[step][1]:
            tokens = 0
            batch: list[int] = []
            while queue and (not batch or tokens + trace[queue[0]].prompt_tokens <= replica.max_batch_tokens):
                index = queue.popleft()
                batch.append(index)
                tokens += trace[index].prompt_tokens
            start = max(now, host_free)
            host_free = start + replica.host_s
            end = host_free + replica.batch_seconds(tokens)
            for index in batch:
                ttft[index] = end - trace[index].at
            heapq.heappush(busy, end)

    while arrived < len(trace) or queue:
        # The next event: an arrival, a batch's end, or a change of count (which may free a slot).
        candidates = []
        if arrived < len(trace):
            candidates.append(trace[arrived].at)
        if busy:
            candidates.append(busy[0])
        if step + 1 < len(starts):
            candidates.append(starts[step + 1])
        now = max(now, min(candidates))
        while step + 1 < len(starts) and starts[step + 1] <= now:
            step += 1
        while busy and busy[0] <= now:
            heapq.heappop(busy)
        while arrived < len(trace) and trace[arrived].at <= now:
            queue.append(arrived)
            arrived += 1
        start_batches()
    return ttft


def attainment(trace: Sequence[TraceRequest], ttfts: Sequence[float], slo: Slo) -> float:
    """The fraction of `trace` whose modelled TTFT meets `slo` (nan for an empty trace)."""
    if not trace:
        return float("nan")
    met = sum(t <= slo.limit(r.prompt_tokens) + 1e-9 for r, t in zip(trace, ttfts, strict=True))
    return met / len(trace)
