"""Chunked prefill under a mix of long and short prompts: TTFT with `--prefill-chunk-tokens N` against
whole prompts (`0`), on the same node and requests, runs alternating.

`python -m engine.bench e2e --chunked N`: a quarter of the requests carry a long prompt
(`--long-prompt` tokens), the others 32–128; every request generates `--max-tokens` tokens. Rows (case
`{model}-c{concurrency}-mix`): `ttft_p50_s`, `ttft_p99_s` and `short_ttft_p99_s` (the short prompts'
alone), chunked over whole.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Awaitable, Callable, Iterable

import trio

from engine.bench.e2e.sides import BENCH, Sample, quantile, with_nodes
from engine.bench.rows import Row, row

WHOLE = "whole-prompts"
Run = Callable[[list[list[int]], int], Awaitable[tuple[float, list[Sample]]]]


def mixed_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Seeded: every fourth prompt long, the others 32–128 tokens."""
    rng = random.Random(3)
    lengths = [args.long_prompt if index % 4 == 0 else rng.randint(32, 128) for index in range(args.requests)]
    return [[rng.randrange(1, min(vocab, 256)) for _ in range(length)] for length in lengths]


def chunked_rows(name: str, prompts: list[list[int]], run: Run, args: argparse.Namespace) -> Iterable[Row]:
    """Alternating runs (`run(prompts, chunk)`; the first of each a warm-up), then the rows."""
    sides: dict[int, list[list[Sample]]] = {args.chunked: [], 0: []}

    async def runs() -> None:
        for attempt in range(args.repeats + 1):
            for chunk in (args.chunked, 0):
                _rate, samples = await run(prompts, chunk)
                if attempt:
                    sides[chunk].append(samples)

    trio.run(runs)
    short = {index for index, prompt in enumerate(prompts) if len(prompt) < args.long_prompt}
    note = (
        f"model {name}, {args.requests} requests (a quarter of {args.long_prompt} tokens, the others 32-128), "
        f"concurrency {args.concurrency}, {args.max_tokens} new tokens, chunks of {args.chunked} tokens "
        f"against whole prompts, median of {args.repeats}"
    )
    case = f"{name}-c{args.concurrency}-mix"

    def figure(chunk: int, q: float, only_short: bool) -> float:
        per_run = []
        for samples in sides[chunk]:
            ttfts = [s.ttft for s in samples if not only_short or s.index in short]
            per_run.append(quantile(ttfts, q))
        return statistics.median(per_run)

    for metric, q, only_short in (("ttft_p50_s", 0.5, False), ("ttft_p99_s", 0.99, False),
                                  ("short_ttft_p99_s", 0.99, True)):  # fmt: skip
        mine, theirs = figure(args.chunked, q, only_short), figure(0, q, only_short)
        yield with_nodes(row(BENCH, case, metric, "lower", mine, theirs, WHOLE, unit="s", note=note), 1)
