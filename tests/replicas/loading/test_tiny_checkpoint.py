"""The built-in tiny model is a real checkpoint: written once into the model cache, reused, rewritten
when damaged, and every load of it — the node's shared one included — equals `tiny_model()`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from replicas.loading.tiny_checkpoint import TINY_FILE, tiny_checkpoint, tiny_vision_seed
from replicas.model import tiny_model
from replicas.model.tiny import TINY_SEED, tiny_tensors
from replicas.weights import ModelHost
from tests.replicas.loading.harness import assert_same_weights


def test_written_once_then_reused(tmp_path: Path) -> None:
    directory = tiny_checkpoint(tmp_path)
    assert directory == tmp_path / "tiny" / f"{TINY_SEED}-c1"
    file = directory / TINY_FILE
    first = file.stat()
    assert tiny_checkpoint(tmp_path) == directory
    again = file.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert [p.name for p in directory.iterdir()] == [TINY_FILE]  # no temporary left behind
    expected, vision_seed = tiny_tensors()
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        assert set(handle.keys()) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
    assert tiny_vision_seed(directory) == vision_seed


def test_a_damaged_file_is_written_again(tmp_path: Path) -> None:
    file = tiny_checkpoint(tmp_path) / TINY_FILE
    file.write_bytes(file.read_bytes()[:1000])
    tiny_checkpoint(tmp_path)
    expected, _ = tiny_tensors()
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        assert torch.equal(handle.get_tensor("lm_head.weight"), expected["lm_head.weight"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_every_tiny_load_reads_it_and_equals_tiny_model(tmp_path: Path, dtype: str) -> None:
    host = ModelHost("tiny", device="cpu", dtype=dtype, cache_dir=str(tmp_path))  # type: ignore[arg-type]
    assert host.checkpoint == tiny_checkpoint(tmp_path)
    model = await host.acquire("prefill-0")
    reference = tiny_model(dtype=dtype)  # type: ignore[arg-type]
    assert_same_weights(model, reference)
    assert model.name == "tiny" and model.vision is not None and reference.vision is not None
    assert model.vision.config == reference.vision.config
    assert torch.equal(model.vision.proj_weight, reference.vision.proj_weight)
    assert host.host_copy is not None and host.host_copy.nbytes == model.parameter_bytes()
    host.release("prefill-0")
    assert host.loaded is None and host.host_copy is not None  # the host copy stays
    again = await host.acquire("decode-0")  # loaded again, from the host copy
    assert again is not model
    assert_same_weights(again, reference)


def test_the_checkpoint_loads_with_the_plain_loader(tmp_path: Path) -> None:
    """A directory with only the safetensors file: `CheckpointFiles` reads it as any checkpoint."""
    from replicas.loading.disk import DiskReader
    from replicas.loading.pieces import checkpoint_pieces
    from replicas.model import TINY_CONFIG

    reader = DiskReader(tiny_checkpoint(tmp_path), TINY_CONFIG)
    expected, _ = tiny_tensors()
    read = {name: t for piece in checkpoint_pieces(TINY_CONFIG) for name, t in reader.read(piece).items()}
    reader.close()
    assert read.keys() == expected.keys()
    assert all(torch.equal(read[name], expected[name]) for name in expected)
