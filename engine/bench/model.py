"""Model executor: prefill and decode tokens/s, zigzag vs HF transformers `generate`, same weights.

A random Llama-architecture checkpoint (~100M parameters, float32 by default) is created with
transformers, saved with `save_pretrained`, and loaded by zigzag's loader, so both sides run the same
weights in the same process with the same thread count. The baseline is pinned: `attn_implementation=
"sdpa"`, HF's own `generate` with its default cache, greedy, as a user would call it; its prefill and
decode times are read from a streamer's timestamps (the prompt is streamed before prefill, then one put
per token). zigzag runs the executor the way a replica does: allocate blocks, one batched prefill that
samples the first token, then one batched decode call per token. Every figure is the median over
`--repeats` alternating runs (after one warm-up run each). Besides tokens per wall-clock second, rows
ending in `-cpu` give tokens per second of process CPU time, which other load on a shared machine
disturbs much less, and `decode-batchN-cpu-ms` the process CPU time of one decode step (the host work a
GPU step costs; lower is better).

`--mixed`: prompt lengths drawn from [prompt/2, 3·prompt/2) instead of all equal; HF gets them
left-padded with an attention mask, as a user batches them, and both are credited the real tokens.
`--modes default batch-invariant`: zigzag rows per executor mode (a row's name ends in `-invariant` for
the batch-invariant kernels; they need a GPU). The note names the executor's path (graphs, kernels,
eager): on a GPU the decode graphs are captured before the first timed run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from typing import Any, final

from engine.bench.rows import Row, row

BENCH = "model"
BASELINE = "hf-transformers-generate-sdpa"
CONFIGS: dict[str, dict[str, Any]] = {
    # ~100M parameters with tied embeddings (the CPU goal's model).
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    ),
    # ~1.1B parameters (the GPU goal's model).
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # The tiny model's width with 16 layers (~10 MB): a copy lands layer by layer in 16 steps, as a real
    # model's does (the ZigZag bench's `--ttft-model deep`).
    "deep": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # A few MB, for smoke runs.
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=sorted(CONFIGS), default="100m", help="model size (default 100m)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    parser.add_argument(
        "--new-tokens", type=int, default=32, help="generated tokens per sequence (default 32)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="measured runs per side (default 5)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for both sides (0 = torch default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small prompt, few tokens, one repeat")
    parser.add_argument("--mixed", action="store_true", help="mixed prompt lengths (HF: left-padded)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["default", "batch-invariant"],
        default=["default"],
        help="zigzag executor modes to measure (default: default)",
    )


def run(args: argparse.Namespace) -> Iterable[Row]:
    import torch
    import transformers

    from replicas.model import load_model

    if args.quick:
        args.prompt_tokens, args.new_tokens, args.repeats = (
            min(args.prompt_tokens, 32),
            min(args.new_tokens, 8),
            1,
        )
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode is timed from the second token on)")
    if "batch-invariant" in args.modes and not args.device.startswith("cuda"):
        raise SystemExit("--modes batch-invariant runs Triton GPU kernels: it needs --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    hf_config = transformers.LlamaConfig(
        **CONFIGS[args.config],
        max_position_embeddings=max(4096, args.prompt_tokens + args.new_tokens),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf_class: Any = transformers.LlamaForCausalLM
    with tempfile.TemporaryDirectory(prefix="zigzag-bench-model-") as directory:
        hf_model = hf_class(hf_config).to(dtype=dtype)
        hf_model.save_pretrained(directory)
        del hf_model
        hf_model = (
            hf_class.from_pretrained(directory, attn_implementation="sdpa", dtype=dtype).to(device).eval()
        )
        models = {
            mode: load_model(
                directory, dtype=args.dtype, device=device, batch_invariant=mode == "batch-invariant"
            )
            for mode in args.modes
        }
    params = sum(p.numel() for p in hf_model.parameters())
    shape = "mixed prompts around" if args.mixed else "prompt"
    note = (
        f"{args.config} ({params / 1e6:.0f}M params) {args.dtype} on {device}, {threads} threads, "
        f"{shape} {args.prompt_tokens}, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    for mode, model in models.items():
        for batch in args.batch:
            yield from _batch_rows(args, mode, model, hf_model, batch, hf_config.vocab_size, note)


def _batch_rows(
    args: argparse.Namespace, mode: str, model: Any, hf_model: Any, batch: int, vocab: int, note: str
) -> Iterable[Row]:
    import torch

    from replicas.model import Executor, KVCache

    device = model.device
    generator = torch.Generator().manual_seed(args.seed + batch)
    if args.mixed:
        low, high = max(1, args.prompt_tokens // 2), max(2, 3 * args.prompt_tokens // 2)
        lengths = torch.randint(low, high, (batch,), generator=generator).tolist()
    else:
        lengths = [args.prompt_tokens] * batch
    prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
    blocks_per_sequence = -(-(max(lengths) + args.new_tokens) // 16)
    cache = KVCache.create(model.config, batch * blocks_per_sequence, device=device)
    executor = Executor(model, cache, cuda_graphs="auto", max_batch=batch)
    path = executor.prepare()
    fallbacks = "".join(f"; fell back: {reason}" for reason in executor.fallbacks)
    suffix_mode = "-invariant" if mode == "batch-invariant" else ""
    zz_runs: list[_Timing] = []
    hf_runs: list[_Timing] = []
    agreement = ""
    for attempt in range(args.repeats + 1):
        zz = _zigzag_run(executor, prompts, args.new_tokens)
        hf = _hf_run(hf_model, prompts, args.new_tokens, device)
        if attempt == 0:
            same = sum(a == b for a, b in zip(zz.tokens, hf.tokens))
            agreement = f"; greedy outputs identical to HF for {same}/{batch} sequences (random weights: ties possible)"
            continue
        zz_runs.append(zz)
        hf_runs.append(hf)
    row_note = f"{note}; zigzag {mode}, path {path}{fallbacks}{agreement}"
    counts = {"prefill": sum(lengths), "decode": batch * (args.new_tokens - 1)}
    for phase, tokens in counts.items():
        for clock, suffix, unit in (("wall", "", "tokens/s"), ("cpu", "-cpu", "tokens/cpu-s")):
            yield row(
                BENCH,
                f"{phase}-{'mixed-' if args.mixed else ''}batch{batch}{suffix}{suffix_mode}",
                f"{phase}_tokens_per_{'s' if clock == 'wall' else 'cpu_s'}",
                "higher",
                tokens / statistics.median(r.seconds(phase, clock) for r in zz_runs),
                tokens / statistics.median(r.seconds(phase, clock) for r in hf_runs),
                BASELINE,
                unit=unit,
                note=row_note,
            )
    steps = args.new_tokens - 1
    yield row(
        BENCH,
        f"decode-{'mixed-' if args.mixed else ''}batch{batch}-cpu-ms{suffix_mode}",
        "decode_step_cpu_ms",
        "lower",
        1e3 * statistics.median(r.seconds("decode", "cpu") for r in zz_runs) / steps,
        1e3 * statistics.median(r.seconds("decode", "cpu") for r in hf_runs) / steps,
        BASELINE,
        unit="ms",
        note=row_note,
    )


@final
class _Timing:
    """Seconds per phase by the wall clock and by the process CPU clock (less sensitive to other load)."""

    def __init__(self, stamps: list[tuple[float, float]], tokens: list[list[int]]) -> None:
        self.stamps = stamps
        self.tokens = tokens

    def seconds(self, phase: str, clock: str) -> float:
        which = 0 if clock == "wall" else 1
        start, prefilled, end = self.stamps
        if phase == "prefill":
            return prefilled[which] - start[which]
        return end[which] - prefilled[which]


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _zigzag_run(executor: Any, prompts: Any, new_tokens: int) -> _Timing:
    """What a replica does: allocate the prompt's blocks, prefill (sampling the first token), then decode
    one token per step, allocating a block whenever a sequence crosses a block boundary."""
    from replicas.model import DecodeSequence, PrefillSequence

    cache = executor.cache
    rows = [list(p) for p in prompts]
    owners = [f"bench-{i}" for i in range(len(rows))]
    _sync(cache.device)
    start = _now()
    tables = [cache.pool.allocate(cache.blocks_for(len(r)), owner) for r, owner in zip(rows, owners)]
    result = executor.prefill([PrefillSequence(block_table=t, token_ids=r) for t, r in zip(tables, rows)])
    generated = [[token] for token in result.tokens]
    _sync(cache.device)
    prefill_done = _now()
    for step in range(1, new_tokens):
        for table, owner, r in zip(tables, owners, rows):
            if len(r) + step > len(table) * cache.block_size:
                table.extend(cache.pool.allocate(1, owner))
        out = executor.decode(
            [
                DecodeSequence(block_table=t, cached_tokens=len(r) + step - 1, token_id=g[-1])
                for t, r, g in zip(tables, rows, generated)
            ]
        )
        for g, token in zip(generated, out.tokens):
            g.append(token)
    _sync(cache.device)
    end = _now()
    for table, owner in zip(tables, owners):
        cache.pool.free(table, owner)
    return _Timing([start, prefill_done, end], generated)


@final
class _Stamps:
    """A transformers streamer that only records when each put happened."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def put(self, value: Any) -> None:
        self.times.append(_now())

    def end(self) -> None:
        self.times.append(_now())


def _hf_run(hf_model: Any, prompts: list[list[int]], new_tokens: int, device: Any) -> _Timing:
    """HF's own `generate` (greedy, default cache); prefill and decode times from the streamer's puts:
    the prompt is put before prefill, then each generated token as soon as it is chosen. Prompts of
    different lengths are left-padded (pad id 0) with an attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for index, prompt in enumerate(prompts):
        ids[index, width - len(prompt) :] = torch.tensor(prompt)
        mask[index, width - len(prompt) :] = 1
    stamps = _Stamps()
    with torch.inference_mode():
        out = hf_model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            streamer=stamps,
        )
    times = stamps.times
    return _Timing([times[0], times[1], times[new_tokens]], out[:, width:].tolist())


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
