"""Bad checkpoints and bad inputs fail with the exact exception and a message naming the file or value."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replicas.model import (
    CheckpointError,
    ContextLengthError,
    DecodeSequence,
    Executor,
    InvalidBatchError,
    KVCache,
    Model,
    PrefillSequence,
    TokenIdError,
    UnsupportedModelError,
    WeightShapeError,
    generate_in_one_piece,
    load_model,
)
from replicas.model.checkpoint.loader import INDEX_FILE, check_checkpoint
from replicas.model.config import read_hf_config
from replicas.model.errors import ModelLoadError
from tests.model.helpers import allocate


@pytest.fixture
def llama_copy(tmp_path: Path, hf_checkpoints: dict[str, tuple[Path, Any]]) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoints["llama"][0], target)
    return target


@pytest.fixture
def sharded_copy(tmp_path: Path, hf_checkpoints: dict[str, tuple[Path, Any]]) -> Path:
    target = tmp_path / "sharded"
    shutil.copytree(hf_checkpoints["llama-sharded"][0], target)
    return target


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path / "nope")
    assert str(info.value) == f"{tmp_path / 'nope'}: not a checkpoint directory (does not exist)"
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    assert (
        str(info.value) == f"{tmp_path / 'config.json'}: missing (a checkpoint directory needs config.json)"
    )


def test_missing_weight_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    (llama_copy / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError) as info:
        load_model(llama_copy)
    assert str(info.value) == (
        f"{llama_copy}: no *.safetensors weight files (pytorch_model.bin found; pickled .bin weights are not loaded)"
    )


def test_missing_shard_named_by_the_index(sharded_copy: Path) -> None:
    index = json.loads((sharded_copy / INDEX_FILE).read_text())
    shard = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (sharded_copy / shard).unlink()
    with pytest.raises(
        CheckpointError, match=rf"{shard}: missing \(listed in {INDEX_FILE} for tensor '.*'\)$"
    ):
        load_model(sharded_copy)


def test_missing_tensor(sharded_copy: Path) -> None:
    path = sharded_copy / INDEX_FILE
    index = json.loads(path.read_text())
    del index["weight_map"]["model.layers.2.self_attn.k_proj.bias"]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_model(sharded_copy)
    assert (
        str(info.value)
        == f"{sharded_copy}: tensor 'model.layers.2.self_attn.k_proj.bias' is in no safetensors file"
    )


def test_a_tokenizer_json_that_is_not_a_file(llama_copy: Path) -> None:
    """It was taken for no tokenizer at all, silently: prompts then needed token ids."""
    (llama_copy / "tokenizer.json").unlink()
    (llama_copy / "tokenizer.json").mkdir()
    with pytest.raises(CheckpointError) as info:
        load_model(llama_copy)
    assert str(info.value) == f"{llama_copy / 'tokenizer.json'}: not a file"


def test_mismatched_shapes_name_tensor_file_and_shapes(llama_copy: Path) -> None:
    _edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(WeightShapeError) as info:
        load_model(llama_copy)
    assert str(info.value) == (
        "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [160, 64], config.json implies [96, 64]"
    )


def _drop_tensor(directory: Path) -> None:
    path = directory / INDEX_FILE
    index = json.loads(path.read_text())
    del index["weight_map"]["model.layers.2.self_attn.k_proj.bias"]
    path.write_text(json.dumps(index))


def _truncate_a_shard(directory: Path) -> None:
    shard = directory / json.loads((directory / INDEX_FILE).read_text())["weight_map"]["lm_head.weight"]
    with shard.open("r+b") as file:
        file.truncate(shard.stat().st_size // 2)


@pytest.mark.parametrize(
    "breakage",
    [
        _drop_tensor,
        _truncate_a_shard,
        lambda directory: _edit_config(directory, intermediate_size=96),
        lambda directory: (directory / "generation_config.json").write_text("{not json"),
    ],
    ids=["missing tensor", "truncated shard", "shapes", "generation config"],
)
def test_the_start_up_check_finds_what_a_load_would_fail_on(
    sharded_copy: Path, breakage: Callable[[Path], object]
) -> None:
    """`check_checkpoint` (run when a node starts, from the files' headers) raises what `load_model`
    raises: a broken checkpoint stops the node at start-up, not at its replicas' first load."""
    check_checkpoint(sharded_copy, read_hf_config(sharded_copy))  # the intact one passes
    breakage(sharded_copy)
    with pytest.raises(ModelLoadError) as loading:
        load_model(sharded_copy)
    with pytest.raises(type(loading.value)) as checking:
        check_checkpoint(sharded_copy, read_hf_config(sharded_copy))
    assert str(checking.value) == str(loading.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "unsupported architectures ['GPT2LMHeadModel']; zigzag runs ['LlamaForCausalLM', 'Qwen2ForCausalLM']",
        ),
        (
            {"architectures": None, "model_type": "mamba"},
            "unsupported model_type 'mamba'; zigzag runs ['llama', 'qwen2']",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (only 'silu')"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": None},
            "rope type 'yarn' is not supported (default, linear, llama3, mrope)",
        ),
        ({"dtype": "int8"}, "dtype 'int8' is not supported (float32, bfloat16, float16)"),
    ],
)
def test_unsupported_models_are_refused(llama_copy: Path, changes: dict[str, object], message: str) -> None:
    _edit_config(llama_copy, **changes)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(llama_copy)
    assert str(info.value) == f"{llama_copy / 'config.json'}: {message}"


def test_broken_config_values_name_the_field(llama_copy: Path) -> None:
    _edit_config(llama_copy, hidden_size="big")
    with pytest.raises(CheckpointError) as info:
        load_model(llama_copy)
    assert (
        str(info.value)
        == f"{llama_copy / 'config.json'}: field 'hidden_size' must be a positive integer, got 'big'"
    )


def test_token_ids_outside_the_vocabulary(tiny: Model) -> None:
    cache = KVCache.create(tiny.config, 4)
    table = allocate(cache, "a", 8)
    executor = Executor(tiny, cache)
    with pytest.raises(
        TokenIdError, match=r"^prefill sequence 0: token id 260 outside the vocabulary \[0, 260\)$"
    ):
        executor.prefill([PrefillSequence(block_table=table, token_ids=[1, 260, 3])])
    with pytest.raises(
        TokenIdError, match=r"^prefill sequence 0: token id -1 outside the vocabulary \[0, 260\)$"
    ):
        executor.prefill([PrefillSequence(block_table=table, token_ids=[-1])])
    with pytest.raises(TokenIdError, match=r"^decode: token id 1000 outside the vocabulary \[0, 260\)$"):
        executor.decode([DecodeSequence(block_table=table, cached_tokens=3, token_id=1000)])
    with pytest.raises(
        TokenIdError, match=r"^prefill sequence 0: token id 300 outside the vocabulary \[0, 260\)$"
    ):
        generate_in_one_piece(tiny, [1, 300])
    assert not cache.storage.tensors["k0"].any(), "a refused call wrote into the cache"


def test_prompt_longer_than_the_context(tiny: Model) -> None:
    prompt = [65] * tiny.context_length
    with pytest.raises(ContextLengthError) as info:
        generate_in_one_piece(tiny, prompt)
    assert str(info.value) == (
        "prompt of 32768 tokens is longer than the context of 32768 tokens of 'tiny' "
        "(it must leave room for one generated token)"
    )
    cache = KVCache.create(tiny.config, 2)
    with pytest.raises(
        ContextLengthError,
        match=r"^prefill sequence 0: 32769 tokens exceed the context of 32768 tokens of 'tiny'$",
    ):
        Executor(tiny, cache).prefill([PrefillSequence(block_table=[0], token_ids=[1], cached_tokens=32768)])


def test_block_tables_that_are_too_short_or_invalid(tiny: Model) -> None:
    cache = KVCache.create(tiny.config, 4)
    executor = Executor(tiny, cache)
    with pytest.raises(
        ContextLengthError,
        match=r"^prefill sequence 1: 17 tokens need 2 blocks of 16, the block table has 1$",
    ):
        executor.prefill(
            [
                PrefillSequence(block_table=[0], token_ids=[1]),
                PrefillSequence(block_table=[1], token_ids=[1] * 17),
            ]
        )
    with pytest.raises(InvalidBatchError, match=r"^decode sequence 0: block id 7 outside \[0, 4\)$"):
        executor.decode([DecodeSequence(block_table=[7], cached_tokens=0, token_id=1)])
    with pytest.raises(
        InvalidBatchError, match=r"^prefill sequence 0: embeds have shape \[2, 5\], expected \[2, 128\]$"
    ):
        executor.prefill(
            [
                PrefillSequence(
                    block_table=[0], token_ids=[1, 2], embeds=torch.zeros(2, 5), embed_indices=[0, 1]
                )
            ]
        )


def test_text_only_checkpoint_refuses_images(hf_checkpoints: dict[str, tuple[Path, Any]]) -> None:
    import numpy as np

    model = load_model(hf_checkpoints["qwen2"][0])
    assert model.vision is None
    with pytest.raises(InvalidBatchError, match=r"^model 'qwen2' has no vision encoder; it takes text only$"):
        generate_in_one_piece(model, [1, 2], images=[np.zeros((16, 16, 3), np.uint8)])
