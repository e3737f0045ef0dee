"""What the e2e benchmark's sides share: a request's sample, a side's runs, the row with its node count,
and `drive`, which sends one run's requests through a node's control socket."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, final

import msgspec
import trio

from engine.bench.rows import Row

BENCH = "e2e"


@dataclass(frozen=True, slots=True)
class Sample:
    ttft: float
    tpot: float | None
    kv_share: float | None
    index: int = -1  # the prompt's, in the run's list


@final
@dataclass(slots=True)
class Side:
    """One side's recorded runs: the rate of each, and every request's sample."""

    rates: list[float] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def add(self, figures: tuple[float, list[Sample]]) -> None:
        self.rates.append(figures[0])
        self.samples += figures[1]

    def quantile(self, pick: Callable[[Sample], float | None], q: float) -> float:
        return quantile([value for s in self.samples if (value := pick(s)) is not None], q)

    def kv_share_mean(self) -> float:
        shares = [s.kv_share for s in self.samples if s.kv_share is not None]
        return statistics.fmean(shares) if shares else float("nan")


@final
class E2eRow(Row, frozen=True, kw_only=True):
    """A row of this benchmark: `nodes` is how many node processes served the project side."""

    nodes: int


def with_nodes(plain: Row, nodes: int) -> E2eRow:
    return E2eRow(**msgspec.structs.asdict(plain), nodes=nodes)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def drive(
    client: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[Sample]]:
    """Send `prompts` through `client` (an `engine.client.ControlClient`), `--concurrency` in flight:
    requests per second from the first sent to the last finished, and each request's sample."""
    from messages.control_replies import GenerateResult

    samples: list[Sample] = []
    limiter = trio.Semaphore(args.concurrency)

    async def one(index: int, prompt: list[int]) -> None:
        async with limiter:
            result: Any = await client.generate_result(
                input_ids=prompt, max_tokens=args.max_tokens, ignore_eos=True
            )
        assert isinstance(result, GenerateResult)
        timings = result.timings
        share = None
        if timings.kv_transfer_s is not None and timings.ttft_s:
            share = timings.kv_transfer_s / timings.ttft_s
        samples.append(Sample(ttft=timings.ttft_s or 0.0, tpot=timings.tpot_s, kv_share=share, index=index))

    started = time.perf_counter()
    async with trio.open_nursery() as clients:
        for index, prompt in enumerate(prompts):
            clients.start_soon(one, index, prompt)
    return len(prompts) / (time.perf_counter() - started), samples
