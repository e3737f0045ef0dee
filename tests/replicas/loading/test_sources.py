"""A replica's own copy of the weights from each source — peer (over inproc, tcp and ucx), host, disk —
equals the model loaded afresh tensor for tensor, in storage of its own; a peer copy puts exactly the
model's bytes on the link; progress rises piece by piece, layer by layer; `status`'s fields follow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from messages.control import SourceChoice
from messages.log.scaling import WeightsCopyFinished, WeightsCopyStarted
from replicas.loading.pieces import checkpoint_pieces, model_bytes, piece_bytes
from replicas.model import tiny_model
from replicas.model.llama import Model
from tests.replicas.loading.harness import Harness, assert_same_weights, running, shares_storage
from transport.kinds import TransportChoice
from transport.links.ucx.library import ucx_installed

PAIR = [("prefill-0", "prefill"), ("decode-0", "decode")]


def check_progress(harness: Harness, name: str, source: str) -> None:
    """One `WeightsProgress` per piece, in checkpoint order, bytes and layers rising to the full model."""
    config = harness.host.config
    events = harness.log.progress(name)
    pieces = checkpoint_pieces(config)
    assert [(e.piece, e.layer) for e in events] == [(p.kind, p.layer) for p in pieces]
    assert [e.layers_loaded for e in events] == [0, *range(1, config.num_layers + 1), 4, 4]
    assert [e.bytes for e in events] == [piece_bytes(config, p) for p in pieces]
    loaded = [e.bytes_loaded for e in events]
    assert loaded == sorted(set(loaded)) and loaded[-1] == model_bytes(config)
    assert {e.weights_source for e in events} == {source}


async def copy_into_decode(harness: Harness, source: SourceChoice) -> Model:
    await harness.load("prefill-0")  # the node's initial replica: the shared resident copy
    assert harness["prefill-0"].snapshot().weights_source == "resident"
    await harness.load("decode-0", source, origin="planner")
    model = harness["decode-0"].model
    assert model is not None and model.fully_loaded
    return model


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("source", ["peer", "host", "disk"])
async def test_each_source_loads_the_same_weights(
    tmp_path: Path, transport: TransportChoice, source: SourceChoice
) -> None:
    async with running(str(tmp_path), PAIR, transport=transport) as harness:
        model = await copy_into_decode(harness, source)
        assert_same_weights(model, tiny_model())
        resident = harness["prefill-0"].model
        assert resident is not None and resident is harness.host.loaded
        assert shares_storage(model, resident) == []
        snap = harness["decode-0"].snapshot()
        assert (snap.weights_source, snap.loaded_layers, snap.total_layers) == (source, 4, 4)
        assert snap.weights_bytes_loaded == model.parameter_bytes() == model_bytes(harness.host.config)
        check_progress(harness, "decode-0", source)
        flows = harness.fabric.bytes_between
        if source == "peer":
            assert flows == {("prefill-0", "decode-0", "weights"): model.parameter_bytes()}
        else:
            assert flows == {}
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert (finished.status, finished.weights_source, finished.fallbacks) == ("success", source, [])


async def test_peer_over_ucx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not ucx_installed():
        pytest.skip("ucxx is not installed (pip install -e '.[ucx]')")
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "sm,tcp"))
    async with running(str(tmp_path), PAIR, transport="ucx") as harness:
        model = await copy_into_decode(harness, "peer")
        assert_same_weights(model, tiny_model())
        assert harness.fabric.bytes_between == {("prefill-0", "decode-0", "weights"): model.parameter_bytes()}
        check_progress(harness, "decode-0", "peer")


async def test_auto_prefers_a_peer_then_the_host_copy(tmp_path: Path) -> None:
    replicas = [*PAIR, ("decode-1", "decode")]
    async with running(str(tmp_path), replicas) as harness:
        await copy_into_decode(harness, "auto")
        assert harness["decode-0"].snapshot().weights_source == "peer"
        # Scaled down to Inactive, decode-0 drops its own copy; the node's host copy stays.
        prefill = harness["prefill-0"]
        for to in ("ShuttingPrefill", "Inactive"):
            await harness.transition("prefill-0", to)
        assert prefill.model is None and harness.host.loaded is None
        await harness.transition("decode-0", "ShuttingDecode")
        await harness.transition("decode-0", "Inactive")
        assert harness["decode-0"].model is None and harness["decode-0"].snapshot().weights_source is None
        assert harness.host.host_copy is not None
        await harness.load("decode-1", "auto", origin="planner")
        started = harness.log.of("decode-1", WeightsCopyStarted)
        assert [(s.requested, s.sources, s.peer) for s in started] == [("auto", ["host", "disk"], None)]
        assert harness["decode-1"].snapshot().weights_source == "host"
        model = harness["decode-1"].model
        assert model is not None
        assert_same_weights(model, tiny_model())


async def test_a_first_load_from_disk_by_a_replica_fills_the_host_copy(tmp_path: Path) -> None:
    replicas = [("decode-0", "decode"), ("decode-1", "decode")]
    async with running(str(tmp_path), replicas) as harness:
        assert harness.host.host_copy is None
        await harness.load("decode-0", "disk", origin="planner")
        host_copy = harness.host.host_copy
        assert host_copy is not None and harness.host.loaded is None  # no resident copy was loaded
        first = harness["decode-0"].model
        assert first is not None
        await harness.load("decode-1", "host", origin="planner")
        second = harness["decode-1"].model
        assert second is not None
        assert_same_weights(second, tiny_model())
        assert shares_storage(first, second) == [] and shares_storage(second, first) == []
