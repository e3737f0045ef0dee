"""Weights land where they are served: a peer copy of a model whose pieces span several staging blocks,
over inproc and tcp, receives every piece straight into its own buffer — the receiving replica's
staging pool never holds a byte — and the sender sends whole blocks from the piece's wire bytes; a link
cut in the middle of a piece drops that piece whole (it is received again, from the next source under
`auto`), so nothing is installed half-landed: a checksum of every installed tensor equals the source's."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from messages.commands import Transition
from messages.faults import DropLink
from messages.log.scaling import WeightsCopyFinished
from replicas.loading.pieces import EMBEDDINGS, layer_piece, model_bytes, piece_bytes
from replicas.loading.staging import BLOCK_BYTES
from replicas.model.llama import Model
from replicas.states import Role
from tests.replicas.loading.harness import Harness, model_tensors, running
from transport.kinds import TransportChoice

PAIR: list[tuple[str, Role]] = [("prefill-0", "prefill"), ("decode-0", "decode")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint whose embeddings (2 blocks and a part) and layers (3 blocks and a part)
    span several 1 MiB staging blocks; its gate/up projection is large enough to be packed on the CPU."""
    import transformers

    directory = tmp_path_factory.mktemp("in-place-model")
    config = transformers.LlamaConfig(
        vocab_size=2100,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def checksums(model: Model) -> dict[str, int]:
    """CRC-32 of every installed weight (fused, dense) of `model`."""
    return {
        name: zlib.crc32(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        for name, tensor in model_tensors(model).items()
    }


def poison_staging(harness: Harness, name: str) -> torch.Tensor:
    """Replica `name`'s weight staging pool, every byte set to 0x5A: what a copy leaves there shows."""
    staging = harness[name]._pools.weights.storage.tensors["bytes"]
    staging.fill_(0x5A)
    return staging


async def copy_to_decode(harness: Harness, source: str) -> Model:
    await harness.load("prefill-0", "disk")
    command = Transition(command_id="load-decode", to="LoadingDecode", origin="planner", source=source)  # type: ignore[arg-type]
    await harness["decode-0"].ask(command)
    await harness.serving("decode-0")
    model = harness["decode-0"].model
    assert model is not None
    return model


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_peer_copy_lands_in_the_pieces_own_buffers(
    tmp_path: Path, checkpoint: Path, transport: TransportChoice
) -> None:
    async with running(str(tmp_path), PAIR, model=str(checkpoint), transport=transport) as harness:
        config = harness.host.config
        assert piece_bytes(config, EMBEDDINGS) > 2 * BLOCK_BYTES
        assert piece_bytes(config, layer_piece(0)) > 3 * BLOCK_BYTES
        staging = poison_staging(harness, "decode-0")
        model = await copy_to_decode(harness, "peer")
        source = harness["prefill-0"].model
        assert source is not None
        assert checksums(model) == checksums(source)
        assert bool((staging == 0x5A).all()), "a byte of the copy landed in the receiver's staging pool"
        assert harness.fabric.bytes_between[("prefill-0", "decode-0", "weights")] == model_bytes(config)
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert finished.status == "success" and finished.weights_source == "peer"


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_a_link_cut_mid_piece_drops_the_piece_whole(
    tmp_path: Path, checkpoint: Path, transport: TransportChoice
) -> None:
    # The embeddings cross whole; the link drops a block into layer 0.
    cut = DropLink(source="prefill-0", destination="decode-0", after_bytes=2_150_400 + BLOCK_BYTES)
    async with running(
        str(tmp_path), PAIR, model=str(checkpoint), transport=transport, faults=[cut]
    ) as harness:
        assert piece_bytes(harness.host.config, EMBEDDINGS) == 2_150_400
        staging = poison_staging(harness, "decode-0")
        model = await copy_to_decode(harness, "auto")
        source = harness["prefill-0"].model
        assert source is not None
        assert checksums(model) == checksums(source)
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert finished.status == "success"
        assert [(f.weights_source, f.piece) for f in finished.fallbacks] == [("peer", "layer 0")]
        pieces = [(e.piece, e.layer, e.weights_source) for e in harness.log.progress("decode-0")]
        assert pieces[:2] == [("embeddings", None, "peer"), ("layer", 0, "host")]
        # Only the piece that landed whole counts as moved over the link.
        assert harness.fabric.bytes_between == {
            ("prefill-0", "decode-0", "weights"): piece_bytes(harness.host.config, EMBEDDINGS)
        }
        assert bool((staging == 0x5A).all())
