"""ZigZag live scale-up through a real node (DESIGN §8): a new prefill replica serves while its weights
arrive, hands its batches to an OldPrefill partner at the layer it reached, and both KV halves land in
one decode replica; every output equals the model run in one piece.

The `hold_weights` fault hook holds the Nth weight copy of the node before layer K, so each scale-up
episode relays at a known boundary: n = 0 (embeddings only), a middle layer, L − 1 and L (every layer,
no head). Requests are sent once the new replica shows exactly K layers loaded, so no relay happens at
another boundary. Each episode ends with both replicas back in `Prefill` by themselves; the new replica
is then scaled down and released (`Inactive`), so the next scale-up copies the weights again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.client import ControlClient
from messages.control import SourceChoice
from messages.control_replies import StatusResult
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
from tests.node.workload import Outcome, check_outcome, mixed_workload, send_all

LAYERS = 4  # the tiny model's
# (hold before layer K, weight source) per episode, in order: the node's 1st … 4th weight copy.
EPISODES: tuple[tuple[int, SourceChoice], ...] = (
    (0, "peer"),
    (2, "host"),
    (LAYERS - 1, "disk"),
    (LAYERS, "auto"),
)
HOLD_SECONDS = 4.0
PER_EPISODE = 10  # requests sent while the new replica holds K layers (32+ over the whole test)


def transports() -> list[str]:
    return sorted({default_transport(), "tcp"})


async def run_episode(
    client: ControlClient, model: Model, *, layer: int, source: SourceChoice, seed: int
) -> list[Outcome]:
    result = await client.scale("prefill", 2, mode="zigzag", source=source)
    assert [s.mode for s in result.started] == ["zigzag"]
    new = result.started[0].replica

    def holding(status: StatusResult) -> bool:  # the embeddings landed: it can take batches
        replica = by_name(status)[new]
        return (
            replica.state == "NewPrefill"
            and replica.loaded_layers == layer
            and replica.weights_bytes_loaded > 0
        )

    await wait_status(client, holding, f"{new} NewPrefill holding {layer} layers")
    status = by_name(await client.status())
    (old,) = status[new].paired_with
    assert status[old].state == "OldPrefill" and status[old].paired_with == [new]
    outcomes = await send_all(client, mixed_workload(model, PER_EPISODE, text=True, seed=seed))
    relayed = [o.result.relay for o in outcomes if o.result.relay is not None]
    assert relayed, f"no request was relayed while {new} held {layer} layers"
    assert {(r.new_prefill, r.old_prefill, r.layer) for r in relayed} == {(new, old, layer)}
    # Loading finishes after the hold: NewPrefill → RefractoryPrefill → Prefill, OldPrefill → Prefill.
    await wait_states(client, {new: "Prefill", old: "Prefill"})
    final = by_name(await client.status())[new]
    assert final.loaded_layers == final.total_layers == LAYERS
    assert final.weights_source in (("peer", "host", "disk") if source == "auto" else (source,))
    await wait_idle(client)
    await client.scale("prefill", 1)
    idle = await wait_status(
        client, lambda s: any(r.state == "ShuttingNull" for r in s.replicas), "a prefill replica ShuttingNull"
    )
    (parked,) = [r.name for r in idle.replicas if r.state == "ShuttingNull"]
    await client.transition(parked, "Inactive")
    return outcomes


@pytest.mark.parametrize("transport", transports())
async def test_scale_up_relays_at_every_boundary_token_exact(
    tmp_path: Path, tiny: Model, transport: str
) -> None:
    holds = [
        f"hold_weights:before_layer={layer},seconds={HOLD_SECONDS},nth={nth}"
        for nth, (layer, _) in enumerate(EPISODES, start=1)
    ]
    options = ["--replicas", "prefill=1,decode=1", "--transport", transport]
    for hold in holds:
        options += ["--fault", hold]
    with node_process(tmp_path, *options) as node:
        outcomes: list[Outcome] = []
        async with node.client() as client:
            await wait_serving(client)
            for index, (layer, source) in enumerate(EPISODES):
                outcomes += await run_episode(client, tiny, layer=layer, source=source, seed=100 + index)
            await wait_idle(client)
    problems = [p for outcome in outcomes for p in check_outcome(tiny, outcome, transport=transport)]
    assert not problems, "\n".join(problems)
    layers_seen = {o.result.relay.layer for o in outcomes if o.result.relay is not None}
    assert layers_seen == {layer for layer, _ in EPISODES}
    relay_events = node.events("relay_received")
    assert {e["layer"] for e in relay_events} == layers_seen
    assert not node.events("replica_failed")
