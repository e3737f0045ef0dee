"""Parity with HF transformers: logits of a batch of different-length prompts, 32-token greedy generations."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from replicas.model import Executor, KVCache, PrefillSequence, load_model
from replicas.model.checkpoint.loader import INDEX_FILE, packs_tied_head
from replicas.model.linear import Kernels
from tests.model.helpers import VOCAB, allocate, first_real_divergence, generate_batch

PROMPT_LENGTHS = (5, 17, 32, 9)


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("kernels", ["packed", "plain"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-sharded"])
def test_batched_prefill_logits_match_hf(
    name: str, kernels: Kernels, hf_checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    directory, hf = hf_checkpoints[name]
    model = load_model(directory, kernels=kernels)
    cache = KVCache.create(model.config, 32)
    prompts = _prompts(7)
    tables = [allocate(cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
    result = Executor(model, cache).prefill(
        [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tables, prompts)]
    )
    assert result.logits is not None and result.tokens is not None
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(result.logits[row], reference, atol=2e-4, rtol=1e-5)
        assert result.tokens[row] == int(reference.argmax())


@pytest.mark.parametrize("kernels", ["packed", "plain"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_generation_matches_hf_generate(
    name: str, kernels: Kernels, hf_checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    directory, hf = hf_checkpoints[name]
    model = load_model(directory, kernels=kernels)
    prompts = _prompts(11)
    ours = generate_batch(model, prompts, 32)
    for prompt, generated in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        reference = out.sequences[0, len(prompt) :].tolist()
        assert len(reference) == 32
        divergence = first_real_divergence(reference, generated, [step[0] for step in out.logits])
        assert divergence is None, (
            f"prompt of {len(prompt)}: diverged at step {divergence}: {reference} vs {generated}"
        )


def test_sharded_checkpoint_has_an_index_and_loads_the_same_weights(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    sharded, _ = hf_checkpoints["llama-sharded"]
    assert (sharded / INDEX_FILE).is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    progress = []
    whole = load_model(hf_checkpoints["llama"][0], kernels="plain")
    parts = load_model(sharded, progress=progress.append, kernels="plain")
    assert [(p.stage, p.layer) for p in progress] == [
        ("embeddings", None),
        *[("layer", i) for i in range(3)],
        ("head", None),
    ]
    assert progress[-1].bytes_loaded == parts.parameter_bytes()
    for mine, theirs in zip(whole.layers, parts.layers):
        assert mine is not None and theirs is not None
        assert torch.equal(mine.qkv.weight, theirs.qkv.weight)
        assert torch.equal(mine.down.weight, theirs.down.weight)
    assert [p.bytes_loaded for p in progress] == sorted({p.bytes_loaded for p in progress})


def test_tokenizer_json_encodes_and_decodes_through_the_loader(
    hf_checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    from tokenizers import Tokenizer

    directory, _ = hf_checkpoints["qwen2"]
    model = load_model(directory)
    assert model.tokenizer is not None
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "hello world the cat sat on the mat zig zag"
    ids = model.tokenizer.encode(text)
    assert ids == reference.encode(text).ids == [3, 4, 5, 6, 7, 8, 5, 9, 10, 11]
    assert model.tokenizer.decode(ids) == text
    assert model.tokenizer.decode([1, 3, 2]) == "hello"
    assert model.tokenizer.encode("dog") == [0]


def test_a_tied_head_is_packed_only_where_the_checkpoint_stores_the_table_as_float32(
    hf_checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    directory, _ = hf_checkpoints["qwen2"]
    assert packs_tied_head(directory)
    packed = load_model(directory, kernels="packed")
    assert packed.lm_head is not None and packed.embed_tokens.layout == torch.strided
    shared = load_model(directory, kernels="packed", pack_tied_head=False)
    assert shared.lm_head is not None and not shared.lm_head.packed
    assert shared.lm_head.weight.data_ptr() == shared.embed_tokens.data_ptr()
    if packed.lm_head.packed:  # this build and CPU run oneDNN: the packed copy is counted
        assert packed.parameter_bytes() == shared.parameter_bytes() + shared.lm_head.nbytes
    narrow = tmp_path / "qwen2-bf16"
    shutil.copytree(directory, narrow)
    tensors = load_file(narrow / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in tensors.items()}, narrow / "model.safetensors")
    assert not packs_tied_head(narrow)
    head = load_model(narrow, dtype="float32", kernels="packed").lm_head
    assert head is not None and not head.packed
