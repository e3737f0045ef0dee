"""Shared helpers of the model tests: random HF checkpoints with sharp logits, batched generation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from replicas.model import DecodeSequence, Executor, KVCache, Model, PrefillSequence, SamplingParams

VOCAB = 320
TIE_TOLERANCE = 1e-4


def build_hf_model(kind: str, directory: Path, *, seed: int, max_shard_size: str | None = None) -> Any:
    """A tiny random HF model saved into `directory` (safetensors + a `tokenizer.json`); returns it in eval mode.

    Weights are redrawn so that logits are sharp (top-2 gaps of several units): ties are rare.
    llama: GQA, q/k/v/o bias, untied head, llama3 rope scaling (older `rope_scaling` spelling).
    qwen2: GQA, q/k/v bias, tied embeddings.
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(
            **common,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_theta=5000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.05 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif "lm_head" in name:
                param.copy_(0.5 * noise)
            else:
                param.copy_(noise / param.shape[1] ** 0.5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    save_tokenizer(directory / "tokenizer.json")
    model.config._attn_implementation = "sdpa"
    return model.eval()


def save_tokenizer(path: Path) -> None:
    """A small word-level `tokenizer.json` built with the `tokenizers` library (ids < VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat", "on", "mat", "zig", "zag"]
    vocab = {word: index for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(path))


def allocate(cache: KVCache, owner: str, tokens: int) -> list[int]:
    return cache.pool.allocate(cache.blocks_for(tokens), owner)


def generate_batch(
    model: Model,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    fragment: bool = False,
) -> list[list[int]]:
    """Generate for all prompts at once: one batched prefill, then batched decode steps (no EOS stop).

    `fragment=True` allocates blocks from a deliberately fragmented pool (interleaved with a filler owner).
    """
    params = sampling or SamplingParams()
    total = max(len(p) for p in prompts) + max_tokens
    per_seq = -(-total // 16)
    cache = KVCache.create(model.config, 2 * per_seq * len(prompts) + 2)
    if fragment:
        filler = [cache.pool.allocate(1, "filler") for _ in range(per_seq * len(prompts))]
        cache.pool.free([ids[0] for ids in filler[::2]], "filler")
    tables = [allocate(cache, f"r{i}", len(p) + max_tokens) for i, p in enumerate(prompts)]
    executor = Executor(model, cache)
    first = executor.prefill(
        [PrefillSequence(block_table=t, token_ids=list(p), sampling=params) for t, p in zip(tables, prompts)]
    )
    assert first.tokens is not None
    outputs = [[token] for token in first.tokens]
    for _ in range(max_tokens - 1):
        step = executor.decode(
            [
                DecodeSequence(
                    block_table=t, cached_tokens=len(p) + len(o) - 1, token_id=o[-1], sampling=params
                )
                for t, p, o in zip(tables, prompts, outputs)
            ]
        )
        for out, token in zip(outputs, step.tokens):
            out.append(token)
    return outputs


def first_real_divergence(
    reference: Sequence[int], candidate: Sequence[int], logits: Sequence[torch.Tensor]
) -> int | None:
    """Index of the first mismatch that is not a genuine tie (reference top-2 gap > TIE_TOLERANCE), else None.

    `logits[i]` is the reference's `[vocab]` logits at step i. After a tie the sequences may differ legitimately,
    so comparison stops at the first mismatch either way.
    """
    for index, (want, got) in enumerate(zip(reference, candidate)):
        if want != got:
            top2 = torch.topk(logits[index].float(), 2).values
            return index if float(top2[0] - top2[1]) > TIE_TOLERANCE else None
    return None


def vllm_apply_penalties(
    logits: torch.Tensor,
    prompt: list[list[int]],
    output: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """vLLM's `apply_penalties` (model_executor/layers/utils.py), written as vLLM writes it: bin counts
    of the output tokens, masks of prompt and output tokens, then in-place updates of the logits."""
    logits = logits.clone()
    num_seqs, vocab = logits.shape
    output_counts = torch.zeros(num_seqs, vocab)
    prompt_mask = torch.zeros(num_seqs, vocab, dtype=torch.bool)
    for row in range(num_seqs):
        for token in output[row]:
            output_counts[row, token] += 1
        for token in prompt[row]:
            prompt_mask[row, token] = True
    output_mask = output_counts > 0
    penalties = torch.tensor(repetition).unsqueeze(1).repeat(1, vocab)
    scale = torch.where(prompt_mask | output_mask, penalties, 1.0)
    logits[logits > 0] /= scale[logits > 0]
    logits[logits <= 0] *= scale[logits <= 0]
    logits -= torch.tensor(frequency).unsqueeze(1) * output_counts
    logits -= torch.tensor(presence).unsqueeze(1) * output_mask
    return logits
