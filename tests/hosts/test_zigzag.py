"""ZigZag pairs across hosts: a NewPrefill replica on one host pairs with an OldPrefill replica on
another; the relays (hidden states and positions after the layers NewPrefill holds) move between the
two hosts, and both KV halves into one decode reservation on a third, over the transfer links between
their `--cluster-host` addresses. Every output equals the model run in one piece. The OldPrefill's node
killed mid-episode: every request ends correct or with a code, no block stays held on the survivors,
and they serve on.

`new` joins empty; `scale prefill 1 node=new mode=zigzag` gives it a replica whose weight copy is held
before layer 2 (the `hold_weights` fault hook), so every relay happens at layer 2 of the tiny model's 4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from engine.client import ControlClient, ControlClientError, ControlError
from engine.hosts.cluster import HostCluster, NodeSpec
from messages.control_replies import StatusResult
from replicas.model import tiny_model
from tests.hosts.conftest import host_cluster, wait_cluster_serving
from tests.node.harness import by_name, wait_idle, wait_status
from tests.node.workload import Ask, Outcome, assert_correct, distinct_asks, send, send_all
from tests.waiting import wait_until

LEASE_TTL = 2
LAYER = 2  # the relays' boundary: the new replica holds layers [0, 2) of 4
NEW = "new/prefill-0"
OLD = "old/prefill-0"
DECODE = "dec/decode-0"
HOLD = ("--fault", f"hold_weights:before_layer={LAYER},seconds=120,nth=1")
LAYOUT = (
    NodeSpec("new", "a", "prefill=0,decode=0", HOLD),
    NodeSpec("old", "b", "prefill=1,decode=0"),
    NodeSpec("dec", "c", "prefill=0,decode=1"),
)


def _events(cluster: HostCluster, node: str, kind: str) -> list[dict[str, object]]:
    found = []
    for path in cluster.nodes[node].log_files:
        if path.exists():
            found += [e for line in path.read_text().splitlines() if (e := json.loads(line))["event"] == kind]
    return found


async def _start_episode(client: ControlClient) -> None:
    """Scale `new` up by ZigZag, paired with `old`'s replica, and wait until it holds `LAYER` layers."""
    with pytest.raises(ControlError, match="a ZigZag partner is a Prefill or OldPrefill replica") as refused:
        await client.scale("prefill", 1, node="new", mode="zigzag", partner=DECODE)
    assert refused.value.code == "bad_request"
    result = await client.scale("prefill", 1, node="new", mode="zigzag", source="disk")
    assert [(s.replica, s.mode, s.source) for s in result.started] == [(NEW, "zigzag", "disk")]

    def holding(status: StatusResult) -> bool:
        replica = by_name(status).get(NEW)
        return replica is not None and replica.state == "NewPrefill" and replica.loaded_layers == LAYER

    status = by_name(await wait_status(client, holding, f"{NEW} NewPrefill holding {LAYER} layers"))
    assert status[NEW].paired_with == [OLD]
    await wait_status(
        client,
        lambda s: by_name(s)[OLD].state == "OldPrefill" and by_name(s)[OLD].paired_with == [NEW],
        f"{OLD} OldPrefill paired with {NEW}, as the new node sees it",
    )


@pytest.mark.slow
async def test_a_pair_across_hosts_relays_and_merges_both_halves_token_exact(tmp_path: Path) -> None:
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL))
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        new = cluster.nodes["new"].address
        assert new is not None
        async with ControlClient.connect(new, token=cluster.token) as client:
            await _start_episode(client)
            outcomes = await send_all(client, distinct_asks(6, max_tokens=5))
            # Prompts entering at `dec` (no prefill replica) go to the NewPrefill as `new`'s router
            # sends them, from `new`'s reports (an OldPrefill takes only its own node's).
            dec = cluster.nodes["dec"].address
            assert dec is not None
            async with ControlClient.connect(dec, token=cluster.token) as elsewhere:
                outcomes += await send_all(elsewhere, distinct_asks(2, max_tokens=5, offset=6))
            assert_correct(model, outcomes)  # token-exact, and the KV halves [0, 2) from NEW, [2, 4) from OLD
            for outcome in outcomes:
                result = outcome.result
                assert result.relay is not None, result
                assert (result.relay.new_prefill, result.relay.old_prefill, result.relay.layer) == (
                    NEW,
                    OLD,
                    LAYER,
                )
                moves = {(t.kind, t.source, t.destination) for t in result.transfers}
                assert moves == {("relay", NEW, OLD), ("kv", NEW, DECODE), ("kv", OLD, DECODE)}, moves
            relayed = _events(cluster, "old", "relay_received")
            assert relayed and {e["layer"] for e in relayed} == {LAYER}
            assert {e["new_prefill"] for e in relayed} == {NEW}
            # Loading finishes: NewPrefill → RefractoryPrefill → Prefill; the OldPrefill sees it in the
            # new node's reports and returns to Prefill by itself.
            assert (await client.release()).released == 1
            await wait_status(
                client,
                lambda s: by_name(s)[NEW].state == "Prefill" and by_name(s)[OLD].state == "Prefill",
                "both replicas of the pair back in Prefill",
            )
            await wait_idle(client)
        assert not _events(cluster, "old", "replica_failed")


# For a decode node killed: `new` has a decode replica too, which serves on.
DECODE_TOO = (
    NodeSpec("new", "a", "prefill=0,decode=1", HOLD),
    NodeSpec("old", "b", "prefill=1,decode=0"),
    NodeSpec("dec", "c", "prefill=0,decode=1"),
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "layout", "survivor_decode"),
    [("old", LAYOUT, DECODE), ("dec", DECODE_TOO, "new/decode-0")],
    ids=["old_prefill", "decode"],
)
async def test_a_node_of_the_episode_killed_mid_episode(
    tmp_path: Path, victim: str, layout: tuple[NodeSpec, ...], survivor_decode: str
) -> None:
    """`victim` — the OldPrefill's node once it received a relay, or a decode node once it holds a
    reservation — killed (SIGKILL), requests in flight: each ends with the model's tokens or an error code a client can act on
    (those the victim held: `replica_failed` once its lease ended; those still on the NewPrefill finish
    there once its weights landed); the survivors hold no block, and serve on token-exact."""
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL))
    survivors = {spec.node_id for spec in layout} - {victim}
    async with host_cluster(tmp_path, layout, *options) as cluster:
        await wait_cluster_serving(cluster, len([s for s in layout if s.replicas != "prefill=0,decode=0"]))
        new = cluster.nodes["new"].address
        assert new is not None
        async with ControlClient.connect(new, token=cluster.token) as client:
            await _start_episode(client)
            outcomes: list[Outcome] = []
            errors: list[ControlError] = []

            async def one(ask: Ask) -> None:
                try:
                    outcomes.append(await send(client, ask))
                except ControlError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for ask in distinct_asks(10, max_tokens=60):
                    nursery.start_soon(one, ask)
                if victim == "old":
                    await wait_until(lambda: _events(cluster, "old", "relay_received"), "a relay on old")
                else:  # a request's halves landed in its reservation there
                    await wait_status(
                        client,
                        lambda s: by_name(s)[DECODE].used_blocks > 0,
                        f"a reservation on {DECODE}",
                        interval=0.01,
                    )
                await cluster.kill(victim)
                await cluster.wait_record(victim, present=False, seconds=30)
                assert (await client.release()).released == 1
            print(f"{len(outcomes)} correct, {len(errors)} failed: {[e.code for e in errors]}")
            assert len(outcomes) + len(errors) == 10
            assert_correct(model, outcomes)
            assert all(e.code in ("replica_failed", "transfer_failed") and e.message for e in errors), errors
            await wait_status(client, lambda s: by_name(s)[NEW].state == "Prefill", f"{NEW} serving plainly")
            await wait_idle(client, nodes=survivors)
            again = await send_all(client, distinct_asks(3, max_tokens=4, offset=20))
            assert_correct(model, again)
            for outcome in again:
                transfers = [(t.source, t.destination) for t in outcome.result.transfers]
                assert transfers in ([(NEW, survivor_decode)], [(OLD, survivor_decode)]), transfers
            await wait_idle(client, nodes=survivors)
        for node in survivors - {"new"}:
            address = cluster.nodes[node].address
            assert address is not None
            async with ControlClient.connect(address, token=cluster.token) as client:
                await wait_idle(client, nodes=survivors)


async def _load(client: ControlClient, count: int, outcomes: list[Outcome], errors: list[Exception]) -> None:
    """`count` requests at once; each ends in `outcomes`, or in `errors` (a coded error, or the node's
    connection lost)."""

    async def one(ask: Ask) -> None:
        try:
            outcomes.append(await send(client, ask))
        except ControlClientError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for ask in distinct_asks(count, max_tokens=30):
            nursery.start_soon(one, ask)


@pytest.mark.slow
async def test_the_new_prefill_node_killed_mid_episode(tmp_path: Path) -> None:
    """`new` killed once its partner received a relay: its clients lose their connection; `old` and
    `dec` end the mirrors of its requests, free their blocks, and serve on (old back in Prefill)."""
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL))
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        new, old = cluster.nodes["new"].address, cluster.nodes["old"].address
        assert new is not None and old is not None
        outcomes: list[Outcome] = []
        errors: list[Exception] = []
        async with ControlClient.connect(new, token=cluster.token) as client:
            await _start_episode(client)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_load, client, 10, outcomes, errors)
                await wait_until(lambda: _events(cluster, "old", "relay_received"), "a relay on old")
                await cluster.kill("new")
        assert len(outcomes) + len(errors) == 10
        assert_correct(model, outcomes)
        async with ControlClient.connect(old, token=cluster.token) as client:
            await wait_status(
                client, lambda s: by_name(s)[OLD].state == "Prefill", f"{OLD} back in Prefill", timeout=30
            )
            await wait_idle(client, nodes={"old", "dec"})
            again = await send_all(client, distinct_asks(3, max_tokens=4, offset=20))
            assert_correct(model, again)
            for outcome in again:
                assert [(t.source, t.destination) for t in outcome.result.transfers] == [(OLD, DECODE)]
            await wait_idle(client, nodes={"old", "dec"})


@pytest.mark.slow
async def test_the_old_prefill_host_cut_off_mid_episode(tmp_path: Path) -> None:
    """Host b (`old`) cut off (its link down) once it received a relay, for longer than the lease TTL:
    the requests it held end `replica_failed` at `new` (or `transfer_failed`, a half that could not
    cross), the rest end correct; `new` and `dec` hold no block and serve on while b stays cut off.
    (A host that comes back rejoins: `test_partition`.)"""
    model = tiny_model()
    options = ("--transport", "tcp", "--lease-ttl", str(LEASE_TTL))
    async with host_cluster(tmp_path, LAYOUT, *options) as cluster:
        await wait_cluster_serving(cluster, 2)
        new, dec = cluster.nodes["new"].address, cluster.nodes["dec"].address
        assert new is not None and dec is not None
        outcomes: list[Outcome] = []
        errors: list[Exception] = []
        async with ControlClient.connect(new, token=cluster.token) as client:
            await _start_episode(client)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_load, client, 10, outcomes, errors)
                await wait_until(lambda: _events(cluster, "old", "relay_received"), "a relay on old")
                await cluster.cut("b")
                await wait_status(
                    client,
                    lambda s: s.cluster is not None and "old" not in s.cluster.nodes,
                    "new seeing old leave once its lease ended",
                    timeout=30,
                )
                assert (await client.release()).released == 1
            assert len(outcomes) + len(errors) == 10
            assert_correct(model, outcomes)
            coded = ("replica_failed", "transfer_failed")
            assert all(isinstance(e, ControlError) and e.code in coded and e.message for e in errors), errors
            await wait_status(client, lambda s: by_name(s)[NEW].state == "Prefill", f"{NEW} serving plainly")
            await wait_idle(client, nodes={"new", "dec"})
            again = await send_all(client, distinct_asks(3, max_tokens=4, offset=20))
            assert_correct(model, again)
            for outcome in again:
                assert [(t.source, t.destination) for t in outcome.result.transfers] == [(NEW, DECODE)]
        async with ControlClient.connect(dec, token=cluster.token) as client:
            await wait_idle(client, nodes={"new", "dec"})
