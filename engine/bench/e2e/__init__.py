"""End to end: the disaggregated node vs the same model run in one piece in one process.

The project side starts a node in this process (prefill=1, decode=1; the transport of `--transport`)
and drives it through its real control socket with a client keeping `--concurrency` requests in
flight. The baseline runs the same requests on one executor with one KV cache in a plain loop —
continuous batching with the same batch limits, no replicas, no transfers, no socket: the model "in one
piece". Both generate exactly `--max-tokens` tokens per request (`ignore_eos`), greedy, from the same
prompts and the same weights. Rows: requests/s (project over baseline, honestly: on 2 CPU cores
disaggregation buys nothing, the point is that its overhead is small), TTFT and TPOT percentiles of both,
and the share of a request's TTFT that its KV transfer took, p50 and mean (the goal: ≤ 10 %).

With `--nodes N` (2 or more) the same requests also run through a cluster of N node processes on a local
etcd (`engine.bench.e2e.cluster`), in the same run, and rows compare the cluster with the one-process
node. Every row carries `nodes`: 1 for the one-process node's rows, N for the cluster's.

With `--chunked N` it measures chunked prefill instead (`engine.bench.e2e.chunked`): TTFT on a mix of
long and short prompts, chunks of N tokens against whole prompts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from engine.bench.e2e.chunked import chunked_rows, mixed_prompts
from engine.bench.e2e.cluster import cluster_rows, cluster_side
from engine.bench.e2e.sides import BENCH, Sample, Side, drive, quantile, with_nodes
from engine.bench.rows import Row, row

BASELINE = "colocated-executor-loop"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", nargs="+", default=["tiny", "100m"], help="tiny and/or 100m (default both)"
    )
    parser.add_argument("--transport", choices=["inproc", "tcp"], default="inproc")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens generated per request (default 32)"
    )
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side (default 3)")
    parser.add_argument("--quick", action="store_true", help="few requests, one repeat, tiny model only")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="2 or more: also through a cluster of this many node processes on a local etcd (tcp)",
    )
    parser.add_argument(
        "--chunked",
        type=int,
        default=0,
        metavar="N",
        help="instead: TTFT on long and short prompts, --prefill-chunk-tokens N against whole prompts",
    )
    parser.add_argument("--long-prompt", type=int, default=3000, help="--chunked: the long prompts' tokens")


def run(args: argparse.Namespace) -> Iterable[Row]:
    if args.quick:
        args.models, args.requests, args.repeats, args.max_tokens = ["tiny"], 8, 1, 8
    for name in args.models:
        with _model_source(name) as source:
            if args.chunked:
                yield from _bench_chunked(name, source, args)
            else:
                yield from _bench_model(name, source, args)


def _bench_chunked(name: str, source: str, args: argparse.Namespace) -> Iterable[Row]:
    from replicas.weights import ModelHost

    vocab = ModelHost(source, device="cpu", dtype="float32").config.vocab_size

    async def run(prompts: list[list[int]], chunk: int) -> tuple[float, list[Sample]]:
        return await _project_run(source, prompts, args, chunk=chunk)

    yield from chunked_rows(name, mixed_prompts(args, vocab), run, args)


@contextmanager
def _model_source(name: str) -> Iterator[str]:
    if name == "tiny":
        yield "tiny"
        return
    import torch
    import transformers

    from engine.bench.model import CONFIGS

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **CONFIGS[name], max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    with tempfile.TemporaryDirectory(prefix="zigzag-bench-e2e-") as directory:
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        yield directory


def _bench_model(name: str, source: str, args: argparse.Namespace) -> Iterable[Row]:
    from replicas.weights import ModelHost

    host = ModelHost(source, device="cpu", dtype="float32")
    vocab = host.config.vocab_size
    rng = random.Random(1)
    prompts = [
        [rng.randrange(1, min(vocab, 256)) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
        for _ in range(args.requests)
    ]
    vision = host.config.image_token_id is not None
    project, baseline, cluster = trio.run(_runs, host, source, prompts, vision, args)
    note = (
        f"model {name}, {args.requests} requests, concurrency {args.concurrency}, prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, {args.max_tokens} new tokens, transport {args.transport}, "
        f"median of {args.repeats}"
    )
    case = f"{name}-c{args.concurrency}-{args.transport}"
    rows = [row(BENCH, case, "requests_per_s", "higher", statistics.median(project.rates),
                statistics.median(baseline.rates), BASELINE, unit="req/s", note=note)]  # fmt: skip
    for metric, pick in (("ttft", lambda s: s.ttft), ("tpot", lambda s: s.tpot)):
        for q in (0.5, 0.9, 0.99):
            mine, theirs = project.quantile(pick, q), baseline.quantile(pick, q)
            rows.append(
                row(
                    BENCH,
                    case,
                    f"{metric}_p{int(q * 100)}_s",
                    "lower",
                    mine,
                    theirs,
                    BASELINE,
                    unit="s",
                    note=note,
                )
            )
    shares = [s.kv_share for s in project.samples if s.kv_share is not None]
    rows.append(
        row(
            BENCH,
            case,
            "kv_transfer_share_of_ttft_p50",
            "lower",
            quantile(shares, 0.5),
            unit="fraction",
            note=note + "; goal <= 0.10",
        )
    )
    rows.append(
        row(
            BENCH,
            case,
            "kv_transfer_share_of_ttft_mean",
            "lower",
            project.kv_share_mean(),
            unit="fraction",
            note=note + "; goal <= 0.10",
        )
    )
    yield from (with_nodes(plain, 1) for plain in rows)
    if cluster is not None:
        yield from cluster_rows(name, args, project, cluster, vision=vision)


async def _runs(
    host: Any, source: str, prompts: list[list[int]], vision: bool, args: argparse.Namespace
) -> tuple[Side, Side, Side | None]:
    """Alternating runs of each side (the one-process node, the baseline, and the cluster when
    `--nodes` asks for one, which stays up through them all); the first of each is a warm-up."""
    project, baseline = Side(), Side()
    cluster = Side() if args.nodes >= 2 else None
    async with cluster_side(source, args, vision=vision) as run_cluster:
        for attempt in range(args.repeats + 1):
            # The warm-up: weights loaded, caches and allocator warm.
            project_run = await _project_run(source, prompts, args)
            baseline_run = await trio.to_thread.run_sync(_baseline_run, host, prompts, args)
            cluster_run = None if run_cluster is None else await run_cluster(prompts)
            if attempt == 0:
                continue
            project.add(project_run)
            baseline.add(baseline_run)
            if cluster is not None and cluster_run is not None:
                cluster.add(cluster_run)
    return project, baseline, cluster


# ---------------------------------------------------------------------------------------------- project
async def _project_run(
    source: str, prompts: list[list[int]], args: argparse.Namespace, *, chunk: int | None = None
) -> tuple[float, list[Sample]]:
    from engine.client import ControlClient
    from engine.config import LogConfig, NodeConfig, ReplicaCounts, SchedulerConfig
    from engine.http.metrics import NodeMetrics
    from engine.logging import open_event_log
    from engine.logs import Aggregator
    from engine.node import Node

    config = NodeConfig(
        listen="127.0.0.1:0",
        http="off",
        model=source,
        replicas=ReplicaCounts(prefill=1, decode=1),
        transport=args.transport,
        log=LogConfig(console=False),
        scheduler=SchedulerConfig(prefill_chunk_tokens=chunk),
    )
    aggregator = Aggregator(keep_requests=False)
    metrics = NodeMetrics()
    log = open_event_log(file=None, console=None, observers=[aggregator.add, metrics.observe])
    node = Node(config, log, aggregator, metrics)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(node.serve)
        async with ControlClient.connect(address) as client:
            with trio.fail_after(120):  # weights load in the background; requests would queue meanwhile
                ready = ("Prefill", "Decode")
                while not all(r.state in ready for r in (await client.status()).replicas):  # noqa: ASYNC110
                    await trio.sleep(0.05)
            figures = await drive(client, prompts, args)
            await client.shutdown()
    log.close()
    return figures


# ---------------------------------------------------------------------------------------------- baseline
def _baseline_run(
    host: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[Sample]]:
    """Continuous batching on one executor: admit up to `concurrency`, prefill new arrivals as a batch,
    then one decode step for every running sequence; the same limits the node's replicas use."""
    from replicas.model import DecodeSequence, Executor, KVCache, PrefillSequence

    model = trio.run(host.acquire, "bench-baseline")
    context = len(max(prompts, key=len)) + args.max_tokens
    cache = KVCache.create(model.config, args.concurrency * (-(-context // 16)) + 1, device="cpu")
    executor = Executor(model, cache)
    waiting = list(range(len(prompts)))
    running: dict[int, tuple[list[int], list[int], float, float | None]] = {}
    samples: list[Sample] = []
    started = time.perf_counter()
    while waiting or running:
        arrivals: list[int] = []
        admitted = time.perf_counter()
        while waiting and len(running) + len(arrivals) < args.concurrency:
            arrivals.append(waiting.pop(0))
        if arrivals:
            tables = {
                i: cache.pool.allocate(cache.blocks_for(len(prompts[i]) + args.max_tokens), str(i))
                for i in arrivals
            }
            result = executor.prefill(
                [PrefillSequence(block_table=tables[i], token_ids=prompts[i]) for i in arrivals]
            )
            now = time.perf_counter()
            assert result.tokens is not None
            for i, token in zip(arrivals, result.tokens, strict=True):
                running[i] = (tables[i], [token], admitted, now)
        if not running:
            continue
        order = list(running)
        step = executor.decode(
            [
                DecodeSequence(
                    block_table=running[i][0],
                    cached_tokens=len(prompts[i]) + len(running[i][1]) - 1,
                    token_id=running[i][1][-1],
                )
                for i in order
            ]
        )
        now = time.perf_counter()
        for i, token in zip(order, step.tokens, strict=True):
            table, generated, arrived, first = running[i]
            generated.append(token)
            if len(generated) >= args.max_tokens:
                cache.pool.free(table, str(i))
                del running[i]
                ttft = (first or now) - arrived
                tpot = (now - (first or now)) / (len(generated) - 1)
                samples.append(Sample(ttft=ttft, tpot=tpot, kv_share=None))
    elapsed = time.perf_counter() - started
    host.release("bench-baseline")
    return len(prompts) / elapsed, samples
