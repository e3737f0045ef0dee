"""Scale ops sent side by side apply one after another, each from the state the one before it left.

Both tests serve a node in the test's own trio run (`tests.epd.inprocess`) with one prefill and one
decode replica. Two concurrent `scale decode 3` used to run side by side: the second saw the first's new
replica still `Inactive` (started, its `LoadingDecode` command not yet handled) and commanded it into
`LoadingDecode` itself, and the first's own command was then refused with `invalid_transition`. Now both
answer the same three replicas, each new replica is commanded once, and the node serves with exactly
three. A scale that finds another holding the node past `SCALE_WAIT` answers `overloaded` and changes
nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from engine import scaling
from engine.client import ControlClient, ControlError
from replicas.model import Model
from tests.epd.images import image_input, image_with_rows, reference
from tests.epd.inprocess import served_node
from tests.node.harness import by_name, wait_states

DECODES = ["decode-0", "decode-1", "decode-2"]


async def test_two_concurrent_scales_to_the_same_target_both_answer_the_same_replicas(tmp_path: Path) -> None:
    async with (
        served_node(tmp_path, "--replicas", "prefill=1,decode=1") as node,
        ControlClient.connect(node.address) as client,
    ):
        await wait_states(client, {"prefill-0": "Prefill", "decode-0": "Decode"})
        answers: list[list[str] | str] = []

        async def scale_decode_to_3() -> None:
            try:
                answers.append((await client.scale("decode", 3)).replicas)
            except ControlError as refused:
                answers.append(f"{refused.code}: {refused.message}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scale_decode_to_3)
            nursery.start_soon(scale_decode_to_3)
        assert answers == [DECODES, DECODES]

        status = await wait_states(client, dict.fromkeys(DECODES, "Decode"))
        assert sorted(by_name(status)) == sorted(["prefill-0", *DECODES])
        assert all(replica.last_error is None for replica in status.replicas)
        result = await client.generate_result(prompt="after the concurrent scales", max_tokens=4)
        assert result.transfers[0].destination in DECODES
        loads = [
            event["replica"]
            for event in node.events("replica_state")
            if event["to"] == "LoadingDecode" and event["replica"] != "decode-0"
        ]
        assert sorted(loads) == ["decode-1", "decode-2"]  # each new replica commanded once


async def test_a_scale_held_up_past_its_wait_answers_overloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scaling, "SCALE_WAIT", 0.1)
    async with (
        served_node(tmp_path, "--replicas", "prefill=1,decode=1") as node,
        ControlClient.connect(node.address) as client,
    ):
        await wait_states(client, {"prefill-0": "Prefill", "decode-0": "Decode"})
        async with node.node.core.scale_lock:  # an earlier scale that does not finish
            with pytest.raises(ControlError) as refused:
                await client.scale("decode", 2)
        assert (refused.value.code, refused.value.message) == (
            "overloaded",
            "an earlier scale op has not finished within 0.1 s; send this one again once it answers",
        )
        assert sorted(by_name(await client.status())) == ["decode-0", "prefill-0"]
        assert (await client.scale("decode", 2)).replicas == ["decode-0", "decode-1"]


async def test_scaling_encode_down_and_up_brings_the_same_replica_back(tmp_path: Path, tiny: Model) -> None:
    """Encode has no Aus state: an idle (`ShuttingNull`) encode replica comes back through `Inactive`.
    (A review found each down-and-up cycle added a new encode replica and left the idle one holding its
    pools.)"""
    async with served_node(tmp_path) as node, ControlClient.connect(node.address) as client:
        await wait_states(client, {"encode-0": "Encode"})
        for _ in range(2):
            assert (await client.scale("encode", 0)).replicas == []
            await wait_states(client, {"encode-0": "ShuttingNull"})
            assert (await client.scale("encode", 1)).replicas == ["encode-0"]
            status = await wait_states(client, {"encode-0": "Encode"})
            assert [r.name for r in status.replicas if r.role == "encode"] == ["encode-0"]
        # Its weights were loaded again: an image request is answered as the model in one piece answers it.
        image = image_with_rows(4, seed=3)
        result = await client.generate_result(
            prompt="<image> after the scales", images=[image_input(image)], max_tokens=3, ignore_eos=True
        )
        assert result.token_ids == reference(tiny, "<image> after the scales", [image], max_tokens=3)
