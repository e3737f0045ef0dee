"""When a source fails mid-copy, `auto` goes on from the next source at the piece it reached and still
loads the same weights; an explicit source fails the copy with a message a person can act on; a copy
that does not fit, or asks for a source the node lacks, is refused before anything moves; the
`hold_weights` hook shows a replica partly loaded, its `Model` already handed over; emulated speed pads
each piece."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import parse_node_config
from messages.commands import Transition
from messages.control import SourceChoice
from messages.faults import DropLink, HoldWeights
from messages.log.events import FaultInjected
from messages.log.scaling import WeightsCopyFinished
from replicas.emulation import EmulatedSpeed
from replicas.loading.copy import WeightCopyFailed, copy_weights
from replicas.loading.memory import available_memory
from replicas.loading.pieces import EMBEDDINGS, layer_piece, model_bytes, piece_bytes
from replicas.model import tiny_model
from replicas.states import ReplicaState
from tests.replicas.loading.harness import SETTINGS, Harness, assert_same_weights, running
from tests.waiting import wait_until
from transport.kinds import TransportChoice

PAIR = [("prefill-0", "prefill"), ("decode-0", "decode")]
# The embeddings (33 rows of 4 KiB) cross the link whole; layer 0 does not.
DROP = DropLink(source="prefill-0", destination="decode-0", after_bytes=300_000)


async def start_copy(harness: Harness, source: SourceChoice) -> None:
    await harness.load("prefill-0")
    command = Transition(command_id="load-decode", to="LoadingDecode", origin="planner", source=source)
    await harness["decode-0"].ask(command)


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_auto_goes_on_from_the_host_copy_when_the_peer_link_drops(
    tmp_path: Path, transport: TransportChoice
) -> None:
    async with running(str(tmp_path), PAIR, transport=transport, faults=[DROP]) as harness:
        await start_copy(harness, "auto")
        await harness.serving("decode-0")
        model = harness["decode-0"].model
        assert model is not None
        assert_same_weights(model, tiny_model())
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert finished.status == "success" and finished.weights_source == "host"
        assert [(f.weights_source, f.piece) for f in finished.fallbacks] == [("peer", "layer 0")]
        sources = [(e.piece, e.weights_source) for e in harness.log.progress("decode-0")]
        assert sources[:2] == [("embeddings", "peer"), ("layer", "host")]
        assert {source for _, source in sources[1:]} == {"host"}
        # Only the piece that landed whole counts as moved over the link.
        config = harness.host.config
        assert harness.fabric.bytes_between == {
            ("prefill-0", "decode-0", "weights"): piece_bytes(config, EMBEDDINGS)
        }
        assert harness["decode-0"].snapshot().weights_source == "host"


async def test_an_explicit_source_that_fails_fails_the_copy_with_the_reason(tmp_path: Path) -> None:
    async with running(str(tmp_path), PAIR, faults=[DROP]) as harness:
        await start_copy(harness, "peer")
        decode = harness["decode-0"]
        await wait_until(lambda: decode.last_error is not None, "decode-0 to fail its copy", 30)
        assert decode.state is ReplicaState.INACTIVE and decode.model is None
        assert decode.last_error is not None
        assert decode.last_error.startswith(
            "WeightCopyFailed: decode-0: copying the weights of tiny from peer replica prefill-0 failed at "
            "layer 0: transfer 'decode-0/weights/"
        ), decode.last_error
        assert decode.last_error.endswith("(source auto, host, disk may serve instead)")
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert finished.status == "failed" and finished.reason is not None
        assert finished.reason in decode.last_error


async def test_a_peer_that_stops_mid_copy_and_the_partly_loaded_model(tmp_path: Path) -> None:
    """Held before layer 2, the copy has handed its `Model` over with layers 0 and 1; the peer stops;
    the copy goes on from the host copy at layer 2."""
    hold = HoldWeights(before_layer=2, seconds=600.0, replica="decode-0", nth=1)
    async with running(str(tmp_path), PAIR, faults=[hold]) as harness:
        await start_copy(harness, "auto")
        decode = harness["decode-0"]
        await wait_until(
            lambda: harness.log.of("decode-0", FaultInjected) and decode.snapshot().loaded_layers == 2,
            "decode-0 to be held before layer 2",
            30,
        )
        partial = decode.model
        assert partial is not None and partial.loaded_layers == 2 and not partial.fully_loaded
        assert decode.state is ReplicaState.LOADING_DECODE and decode.snapshot().executor is not None
        config = harness.host.config
        two_layers = piece_bytes(config, EMBEDDINGS) + 2 * piece_bytes(config, layer_piece(0))
        assert decode.snapshot().weights_bytes_loaded == partial.parameter_bytes() == two_layers
        harness.stop("prefill-0")
        assert harness.faults.release_holds() == 1
        await harness.serving("decode-0")
        assert decode.model is partial and partial.fully_loaded
        assert_same_weights(partial, tiny_model())
        (finished,) = harness.log.of("decode-0", WeightsCopyFinished)
        assert [(f.weights_source, f.piece) for f in finished.fallbacks] == [("peer", "layer 2")]
        (held,) = harness.log.of("decode-0", FaultInjected)
        assert held.fault == "hold_weights" and "before layer 2" in held.detail


async def test_a_copy_that_does_not_fit_is_refused_naming_the_bytes(tmp_path: Path) -> None:
    async with running(str(tmp_path), PAIR) as harness:
        pieces: list[object] = []
        with pytest.raises(WeightCopyFailed) as refused:
            await copy_weights(
                harness.target("decode-0"),
                "disk",
                on_model=pieces.append,
                on_piece=pieces.append,
                memory_probe=lambda device: 1000,
            )
        needed = model_bytes(harness.host.config)
        assert str(refused.value) == (
            f"decode-0: refused to copy the weights of tiny: the copy needs {needed} bytes (0.00 GiB) on cpu, "
            "but only 1000 bytes (0.00 GiB, MemAvailable) are available; free memory (scale a replica down "
            "to Inactive) or use a smaller dtype"
        )
        assert pieces == []
    available = available_memory(harness.host.frame().device)
    assert available is not None and available > 0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "peer",
            "decode-0: no other running replica, of this node or another, holds a fully loaded copy of tiny "
            "to copy from (source peer); use source auto, host or disk",
        ),
        (
            "host",
            "decode-0: the node holds no host-memory copy of tiny yet (it is filled when the node first loads "
            "the model from disk; source host); use source auto or disk",
        ),
    ],
)
async def test_a_source_the_node_lacks_is_refused(tmp_path: Path, source: SourceChoice, message: str) -> None:
    async with running(str(tmp_path), PAIR) as harness:  # nothing loaded yet: no peer, no host copy
        with pytest.raises(WeightCopyFailed, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
            await copy_weights(harness.target("decode-0"), source, on_model=print, on_piece=print)


@pytest.mark.parametrize(
    "emulated",
    [
        EmulatedSpeed(weights_gb_per_s=0.05),
        # the disk's own speed wins over the default for every source
        EmulatedSpeed(weights_gb_per_s=1000.0, peer_gb_per_s=1000.0, disk_gb_per_s=0.05),
    ],
)
async def test_emulated_speed_pads_every_piece(tmp_path: Path, emulated: EmulatedSpeed) -> None:
    speed = 0.05  # GB/s from disk: tiny's 2.6 MB take about 50 ms
    settings = SETTINGS.__class__(
        **{name: getattr(SETTINGS, name) for name in SETTINGS.__struct_fields__ if name != "emulated"},
        emulated=emulated,
    )
    async with running(str(tmp_path), PAIR, settings=settings) as harness:
        await start_copy(harness, "disk")
        await harness.serving("decode-0")
        progress = harness.log.progress("decode-0")
        assert len(progress) == 7
        for event in progress:
            assert event.bytes is not None and event.piece_seconds is not None
            assert event.piece_seconds >= event.bytes / (speed * 1e9), event


def test_the_hold_weights_hook_is_a_node_option() -> None:
    config = parse_node_config(["--fault", "hold_weights:before_layer=4,seconds=1.5,replica=decode-0,nth=2"])
    assert config.faults == [HoldWeights(before_layer=4, seconds=1.5, replica="decode-0", nth=2)]
