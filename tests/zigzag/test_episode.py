"""The ZigZag episode's control surface through a real node: pairing by `transition`, a scale-down that
waits for the episode, the mode and source checks of `scale`."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from engine.client import ControlError
from replicas.model import Model
from tests.node.harness import (
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_states,
    wait_status,
)
from tests.node.workload import assert_correct, distinct_asks, send

ZIGZAG = frozenset({"NewPrefill", "OldPrefill", "RefractoryPrefill"})


async def test_transition_pairs_and_scale_down_waits_for_the_episode(tmp_path: Path, tiny: Model) -> None:
    with node_process(
        tmp_path, "--replicas", "prefill=2,decode=1", "--fault", "hold_weights:before_layer=1,seconds=600"
    ) as node:
        async with node.client() as client:
            await wait_serving(client)
            with pytest.raises(ControlError) as refused:
                await client.scale("decode", 2, mode="zigzag")
            assert (refused.value.code, refused.value.message) == (
                "bad_request",
                "mode zigzag scales prefill only; decode loads stop_the_world",
            )
            # prefill-1 out of service, then back by hand: LoadingPrefill from the host copy, paired with
            # prefill-0 by name.
            await client.transition("prefill-1", "ShuttingPrefill")
            await wait_states(client, {"prefill-1": "ShuttingNull"})
            await client.transition("prefill-1", "Inactive")
            await client.transition("prefill-1", "LoadingPrefill", source="host")
            result = await client.transition("prefill-1", "NewPrefill", paired_with="prefill-0")
            assert result.previous == "LoadingPrefill"
            status = by_name(await client.status())
            assert (status["prefill-1"].state, status["prefill-1"].paired_with) == (
                "NewPrefill",
                ["prefill-0"],
            )
            assert (status["prefill-0"].state, status["prefill-0"].paired_with) == (
                "OldPrefill",
                ["prefill-1"],
            )
            await wait_status(
                client, lambda s: by_name(s)["prefill-1"].loaded_layers == 1, "prefill-1 holding one layer"
            )
            outcome = await send(client, distinct_asks(1, max_tokens=3, offset=40)[0])
            assert outcome.result.token_ids  # served during the episode
            # A scale-down waits for the episode to end: when it answers, nobody is in a ZigZag state.
            # It is sent while the copy is held; the hold is then released (`release`).
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.scale, "prefill", 1)
                await trio.testing.wait_all_tasks_blocked()  # the scale op is on its way
                assert (await client.release()).released == 1
            after = await client.status()
            assert not [r.name for r in after.replicas if r.state in ZIGZAG]
            assert by_name(after)["prefill-1"].weights_source == "host"
            await wait_idle(client)
            after_outcome = await send(client, distinct_asks(1, max_tokens=3, offset=50)[0])
            assert_correct(tiny, [outcome, after_outcome], transport=default_transport())
            await wait_idle(client)
