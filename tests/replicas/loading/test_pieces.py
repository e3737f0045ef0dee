"""The pieces of a copy: checkpoint order, tensor tables, a loaded model split back into the checkpoint's
tensors (fused weights by rows, oneDNN-packed ones made dense), staging bytes in and out of
scattered blocks, and a builder that takes pieces in order only."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from messages.weights import WeightPiece
from replicas.loading.builder import ModelBuilder, ModelFrame
from replicas.loading.pieces import (
    EMBEDDINGS,
    HEAD_PIECE,
    NORM_PIECE,
    checkpoint_pieces,
    layer_piece,
    model_bytes,
    piece_bytes,
    tensor_table,
)
from replicas.loading.split import model_piece
from replicas.loading.staging import BLOCK_BYTES, WEIGHTS_LAYOUT, copy_out, rows_for, stage
from replicas.model import TINY_CONFIG, tiny_model
from replicas.model.tiny import tiny_tensors
from tests.replicas.loading.harness import assert_same_weights
from transport.memory.storage import PoolStorage


def test_checkpoint_order_and_sizes() -> None:
    pieces = checkpoint_pieces(TINY_CONFIG)
    assert pieces == [EMBEDDINGS, *(layer_piece(i) for i in range(4)), NORM_PIECE, HEAD_PIECE]
    tied = msgspec.structs.replace(TINY_CONFIG, tie_word_embeddings=True)
    assert checkpoint_pieces(tied)[-1] == NORM_PIECE
    assert model_bytes(TINY_CONFIG) == tiny_model().parameter_bytes()
    table = tensor_table(TINY_CONFIG, layer_piece(1))
    assert table[0].name == "model.layers.1.input_layernorm.weight" and table[0].offset == 0
    assert all(a.offset + a.nbytes == b.offset for a, b in itertools.pairwise(table))
    assert piece_bytes(msgspec.structs.replace(TINY_CONFIG, dtype="bfloat16"), EMBEDDINGS) == 260 * 128 * 2
    with pytest.raises(ValueError, match="a layer index goes with kind 'layer' only"):
        WeightPiece(kind="norm", layer=1)


@pytest.mark.parametrize("kernels", ["plain", "packed"])
def test_a_loaded_model_splits_back_into_the_checkpoint(kernels: str) -> None:
    model = tiny_model(kernels=kernels)  # type: ignore[arg-type]
    if kernels == "packed":
        assert model.layers[0] is not None
        if not model.layers[0].gate_up.packed:
            pytest.skip("this PyTorch cannot pack weights for oneDNN")
    expected, _ = tiny_tensors()
    split = {name: t for piece in checkpoint_pieces(model.config) for name, t in model_piece(model, piece)}
    assert split.keys() == expected.keys()
    for name, tensor in expected.items():
        assert split[name].layout == torch.strided and split[name].is_contiguous(), name
        assert torch.equal(split[name], tensor), name


def test_staging_round_trip_through_scattered_blocks() -> None:
    storage = PoolStorage(WEIGHTS_LAYOUT, 4)
    tensors = [torch.arange(300_000, dtype=torch.float32), torch.arange(7, dtype=torch.float32) - 3]
    piece = torch.cat([t.view(torch.uint8) for t in tensors])
    start, nbytes = 13, 1_200_010  # not row-aligned, spans both tensors and both blocks
    blocks = [3, 1]
    stage(storage, blocks, tensors, start, nbytes)
    target = torch.zeros(piece.numel(), dtype=torch.uint8)
    rows = rows_for(nbytes)
    first = 100  # land as two rounds, the second from row 100
    assert copy_out(storage, blocks, 0, first, target, start, nbytes) == first * 4096
    copied = copy_out(
        storage, blocks, first, rows - first, target, start + first * 4096, nbytes - first * 4096
    )
    assert first * 4096 + copied == nbytes
    assert torch.equal(target[start : start + nbytes], piece[start : start + nbytes])
    assert int(target[:start].count_nonzero()) == 0 and int(target[start + nbytes :].count_nonzero()) == 0
    with pytest.raises(ValueError, match="do not fit"):
        stage(storage, [0], tensors, 0, BLOCK_BYTES + 1)


def test_the_builder_takes_pieces_in_order_and_checks_shapes() -> None:
    frame = ModelFrame(config=TINY_CONFIG, device=torch.device("cpu"), name="tiny", vision_seed=None)
    builder = ModelBuilder(frame)
    tensors, _ = tiny_tensors()
    with pytest.raises(ValueError, match="layer 0 landed, expected embeddings"):
        builder.add(layer_piece(0), {})
    from replicas.model.errors import WeightShapeError

    with pytest.raises(WeightShapeError, match="has shape"):
        builder.add(EMBEDDINGS, {"model.embed_tokens.weight": torch.zeros(3, 3)})
    for piece in builder.pieces:
        names = [t.name for t in tensor_table(TINY_CONFIG, piece)]
        model = builder.add(piece, {name: tensors[name] for name in names})
        if piece == EMBEDDINGS:
            assert model.loaded_layers == 0 and not model.fully_loaded
    assert builder.done and builder.model is not None and builder.model.fully_loaded
    reference = tiny_model()
    reference.vision = None
    assert_same_weights(builder.model, reference)
