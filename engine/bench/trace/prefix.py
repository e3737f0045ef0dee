"""prefix: the prefix cache on a trace in Mooncake's format, against the same node with --prefix-cache off.

The trace (JSON lines: `timestamp` ms, `input_length`, `output_length`, `hash_ids` — one id per 512-token
block, equal ids meaning equal content): by default a slice of Mooncake's FAST'25
`traces/synthetic_trace.jsonl` (its requests 3601–3900; engine/bench/trace/data/README.md), or `--trace
FILE`. Scaled to this machine: each hash id becomes one KV block of `--block-tokens` (16) token ids drawn
from a generator seeded with the id (equal ids, equal tokens), a prompt is `input_length` × block-tokens /
512 tokens (at most its blocks'), an output `output_length` / `--output-divisor` (16) tokens (at least 1);
`--limit` keeps the first requests, `--time-scale` multiplies the arrival times (4 by default: a quarter
of the trace's rate, what the tiny model computes on two shared cores).

Each way replays the trace open-loop (every request sent at its arrival time) on its own node process —
tiny model, `--replicas prefill=1,decode=1`, the same `--kv-pool-blocks`, the prefill replica emulating an
accelerator (`--prefill-tokens-per-s`, 1000 by default: the node then spends its prefill time on the
tokens it computes, as a GPU would) — with `--prefix-cache on --prefix-cache-blocks` a quarter
(`--cache-fraction`) of the trace's distinct blocks, and with `--prefix-cache off`. Rows: prefill tokens
computed (from the `prefill_started` events: tokens − cached_tokens), TTFT p50 and p99, requests/s (the
requests over the time from the first arrival to the last result), each against cache off; and the hit
rate (cached blocks / prompt blocks) against the trace's own bound (the fraction of its blocks seen
before, with an unbounded cache) and against the best a cache of that size can reach — Belady's offline
rule replayed through a model of the cache (engine/bench/trace/ceiling.py; the note adds the model's LRU,
what the node runs). Goals: hit rate ≥ 0.9 × the bound; TTFT p50 ≤ 0.6 × cache off.

`--nodes N` (2 or more) replays the trace on N nodes instead, KV-aware routing across one cluster against
round-robin over separate nodes (engine/bench/trace/prefix_cluster.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import trio

from engine.bench.nodes import node_process, read_events
from engine.bench.rows import Row, row
from engine.bench.trace.ceiling import model_hit_rate
from engine.bench.trace.prefix_cluster import run_cluster

BENCH: Final = "prefix"
SLICE: Final = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_slice.jsonl"
TRACE_BLOCK: Final = 512  # tokens per hash id in Mooncake's traces
VOCABULARY: Final = 256  # token ids are drawn from [1, VOCABULARY): the tiny model's bytes
SERVE_SECONDS: Final = 60.0
DRAIN_SECONDS: Final = 300.0


@final
@dataclass(frozen=True, slots=True)
class Request:
    at: float  # seconds from the trace's start
    prompt: list[int]
    hash_ids: list[int]
    output_tokens: int


@final
@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    ttft: float
    end: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=SLICE, help="a trace in Mooncake's JSON-lines format")
    parser.add_argument("--limit", type=int, default=300, help="replay the first N requests")
    parser.add_argument("--time-scale", type=float, default=4.0, help="multiply the arrival times")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per hash id (a KV block)")
    parser.add_argument("--output-divisor", type=int, default=16, help="divide output lengths by this")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=1000.0)
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="of the trace's distinct blocks")
    parser.add_argument("--kv-pool-blocks", type=int, default=4096)
    parser.add_argument("--logs", type=Path, default=None, help="keep the nodes' logs here")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="2 or more: N nodes, KV-aware against round-robin (prefix_cluster.py)",
    )


def load(
    path: Path, *, limit: int, time_scale: float, block_tokens: int, output_divisor: int
) -> list[Request]:
    """The trace's first `limit` requests, scaled (see the module docstring)."""
    requests: list[Request] = []
    blocks: dict[int, list[int]] = {}
    with path.open() as lines:
        for line in lines:
            if len(requests) >= limit:
                break
            if not line.strip():
                continue
            entry = json.loads(line)
            ids = [int(h) for h in entry["hash_ids"]]
            tokens = [t for h in ids for t in blocks.setdefault(h, _block(h, block_tokens))]
            length = max(1, min(len(tokens), round(entry["input_length"] * block_tokens / TRACE_BLOCK)))
            output = max(1, int(entry["output_length"]) // output_divisor)
            requests.append(Request(entry["timestamp"] / 1000 * time_scale, tokens[:length], ids, output))
    start = min((r.at for r in requests), default=0.0)
    return [Request(r.at - start, r.prompt, r.hash_ids, r.output_tokens) for r in requests]


def _block(hash_id: int, block_tokens: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(1, VOCABULARY) for _ in range(block_tokens)]


def bound(requests: Sequence[Request]) -> tuple[float, int]:
    """The trace's hit-rate bound (blocks seen before / blocks) and its distinct blocks."""
    seen: set[int] = set()
    total = repeated = 0
    for request in requests:
        for h in request.hash_ids:
            total += 1
            repeated += h in seen
            seen.add(h)
    return (repeated / total if total else 0.0), len(seen)


def run(args: argparse.Namespace) -> Iterator[Row]:
    if args.nodes < 1:
        raise SystemExit(f"--nodes must be 1 or more, not {args.nodes}")
    requests = load(
        args.trace,
        limit=args.limit,
        time_scale=args.time_scale / args.nodes,
        block_tokens=args.block_tokens,
        output_divisor=args.output_divisor,
    )
    limit, distinct = bound(requests)
    cache_blocks = math.ceil(args.cache_fraction * distinct)
    common = [
        "--kv-block-size",
        str(args.block_tokens),
        "--kv-pool-blocks",
        str(max(args.kv_pool_blocks, cache_blocks + 4 * max(len(r.hash_ids) for r in requests))),
        "--emulated-speed",
        f"prefill_tokens_per_s={args.prefill_tokens_per_s:g}",
        "--max-queue",
        str(len(requests) + 8),
    ]
    cached = [*common, "--prefix-cache", "on", "--prefix-cache-blocks", str(cache_blocks)]
    if args.nodes > 1:
        case = (
            f"{args.trace.name}[:{len(requests)}] {args.block_tokens} tok/block x{args.time_scale / args.nodes:.3g}, "
            f"{args.nodes} nodes, cache {cache_blocks} blocks each"
        )
        yield from run_cluster(args, requests, cached, case=case, bound=limit)
        return
    ways = {
        "on": [*cached, "--replicas", "prefill=1,decode=1"],
        "off": [*common, "--prefix-cache", "off", "--replicas", "prefill=1,decode=1"],
    }
    with tempfile.TemporaryDirectory(prefix="zigzag-prefix-") as scratch:
        directory = args.logs or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        figures = {
            way: _replay(requests, options, directory / f"prefix-{way}.jsonl")
            for way, options in ways.items()
        }
    on, off = figures["on"], figures["off"]
    case = (
        f"{args.trace.name}[:{len(requests)}] {args.block_tokens} tok/block x{args.time_scale:g}, "
        f"cache {cache_blocks} blocks"
    )
    note = (
        f"tiny model, prefill emulated at {args.prefill_tokens_per_s:g} tokens/s; "
        f"{distinct} distinct blocks; outputs / {args.output_divisor}"
    )
    yield row(
        BENCH, case, "prefill tokens computed", "lower", on.computed, off.computed, "cache off", note=note
    )
    yield row(BENCH, case, "TTFT p50", "lower", on.ttft_p50, off.ttft_p50, "cache off", unit="s")
    yield row(BENCH, case, "TTFT p99", "lower", on.ttft_p99, off.ttft_p99, "cache off", unit="s")
    yield row(BENCH, case, "requests/s", "higher", on.rate, off.rate, "cache off")
    yield row(BENCH, case, "hit rate (blocks)", "higher", on.hit_rate, limit, "trace's bound")
    optimum = model_hit_rate(requests, args.block_tokens, cache_blocks, "belady")
    lru = model_hit_rate(requests, args.block_tokens, cache_blocks, "lru")
    yield row(
        BENCH,
        case,
        "hit rate vs offline optimum",
        "higher",
        on.hit_rate,
        optimum,
        "Belady (model)",
        note=f"the model's LRU: {lru:.3f}",
    )


@final
@dataclass(frozen=True, slots=True)
class Figures:
    computed: float
    ttft_p50: float
    ttft_p99: float
    rate: float
    hit_rate: float


def _replay(requests: Sequence[Request], options: Sequence[str], log_file: Path) -> Figures:
    log_file.unlink(missing_ok=True)
    with node_process(log_file, options) as address:
        results = trio.run(_send_all, address, requests)
    started = {e["request_id"]: e for e in read_events(log_file, "prefill_started")}
    ours = [started[r.request_id] for r in results if r.request_id in started]
    computed = sum(e["tokens"] - e.get("cached_tokens", 0) for e in ours)
    block = int(options[options.index("--kv-block-size") + 1])
    cached_blocks = sum(e.get("cached_tokens", 0) for e in ours) // block
    ttfts = sorted(r.ttft for r in results)
    span = max(r.end for r in results)
    return Figures(
        computed=float(computed),
        ttft_p50=statistics.median(ttfts),
        ttft_p99=ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)],
        rate=len(results) / span if span > 0 else 0.0,
        hit_rate=cached_blocks / sum(len(r.hash_ids) for r in requests),
    )


async def _send_all(address: str, requests: Sequence[Request]) -> list[Result]:
    from engine.client import ControlClient

    results: list[Result] = []
    async with ControlClient.connect(address) as client:
        with trio.fail_after(SERVE_SECONDS):
            while not all(r.state in ("Prefill", "Decode") for r in (await client.status()).replicas):  # noqa: ASYNC110
                await trio.sleep(0.05)
        warm = random.Random(0)
        for _ in range(2):  # unrecorded, and sharing no block with the trace: first-call costs
            ids = [warm.randrange(1, VOCABULARY) for _ in range(40)]
            await client.generate_result(input_ids=ids, max_tokens=2, ignore_eos=True)
        started = trio.current_time() + 0.1

        async def one(request: Request) -> None:
            await trio.sleep_until(started + request.at)
            result = await client.generate_result(
                input_ids=request.prompt, max_tokens=request.output_tokens, ignore_eos=True
            )
            assert result.timings.ttft_s is not None
            results.append(Result(result.request_id, result.timings.ttft_s, trio.current_time() - started))

        with trio.fail_after(max((r.at for r in requests), default=0.0) + DRAIN_SECONDS):
            async with trio.open_nursery() as nursery:
                for request in requests:
                    nursery.start_soon(one, request)
        await client.shutdown()
    return results
