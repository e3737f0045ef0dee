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
disturbs much less.
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


def run(args: argparse.Namespace) -> Iterable[Row]:
    import torch
    import transformers

    from replicas.model import Executor, KVCache, load_model

    if args.quick:
        args.prompt_tokens, args.new_tokens, args.repeats = (
            min(args.prompt_tokens, 32),
            min(args.new_tokens, 8),
            1,
        )
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode is timed from the second token on)")
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
        model = load_model(directory, dtype=args.dtype, device=device)
    params = sum(p.numel() for p in hf_model.parameters())
    note = (
        f"{args.config} ({params / 1e6:.0f}M params) {args.dtype} on {device}, {threads} threads, "
        f"prompt {args.prompt_tokens}, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    for batch in args.batch:
        generator = torch.Generator().manual_seed(args.seed + batch)
        prompts = torch.randint(1, hf_config.vocab_size, (batch, args.prompt_tokens), generator=generator)
        blocks_per_sequence = -(-(args.prompt_tokens + args.new_tokens) // 16)
        executor = Executor(model, KVCache.create(model.config, batch * blocks_per_sequence, device=device))
        zz_runs: list[_Timing] = []
        hf_runs: list[_Timing] = []
        agreement = ""
        for attempt in range(args.repeats + 1):
            zz = _zigzag_run(executor, prompts, args.new_tokens)
            hf = _hf_run(hf_model, prompts.to(device), args.new_tokens)
            if attempt == 0:
                same = sum(a == b for a, b in zip(zz.tokens, hf.tokens))
                agreement = f"; greedy outputs identical to HF for {same}/{batch} sequences (random weights: ties possible)"
                continue
            zz_runs.append(zz)
            hf_runs.append(hf)
        counts = {"prefill": batch * args.prompt_tokens, "decode": batch * (args.new_tokens - 1)}
        for phase, tokens in counts.items():
            for clock, suffix, unit in (("wall", "", "tokens/s"), ("cpu", "-cpu", "tokens/cpu-s")):
                yield row(
                    BENCH,
                    f"{phase}-batch{batch}{suffix}",
                    f"{phase}_tokens_per_{'s' if clock == 'wall' else 'cpu_s'}",
                    "higher",
                    tokens / statistics.median(r.seconds(phase, clock) for r in zz_runs),
                    tokens / statistics.median(r.seconds(phase, clock) for r in hf_runs),
                    BASELINE,
                    unit=unit,
                    note=note + agreement,
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
    batch, prompt_len = prompts.shape
    rows = prompts.tolist()
    owners = [f"bench-{i}" for i in range(batch)]
    _sync(cache.device)
    start = _now()
    tables = [cache.pool.allocate(cache.blocks_for(prompt_len), owner) for owner in owners]
    result = executor.prefill([PrefillSequence(block_table=t, token_ids=r) for t, r in zip(tables, rows)])
    generated = [[token] for token in result.tokens]
    _sync(cache.device)
    prefill_done = _now()
    for step in range(1, new_tokens):
        cached = prompt_len + step - 1
        if cached + 1 > len(tables[0]) * cache.block_size:
            for table, owner in zip(tables, owners):
                table.extend(cache.pool.allocate(1, owner))
        out = executor.decode(
            [
                DecodeSequence(block_table=t, cached_tokens=cached, token_id=g[-1])
                for t, g in zip(tables, generated)
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


def _hf_run(hf_model: Any, prompts: Any, new_tokens: int) -> _Timing:
    """HF's own `generate` (greedy, default cache); prefill and decode times from the streamer's puts:
    the prompt is put before prefill, then each generated token as soon as it is chosen."""
    import torch

    stamps = _Stamps()
    with torch.inference_mode():
        out = hf_model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            streamer=stamps,
        )
    times = stamps.times
    return _Timing([times[0], times[1], times[new_tokens]], out[:, prompts.shape[1] :].tolist())


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
