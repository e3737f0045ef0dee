"""The replica state machine of architecture §6, driven through the `transition` op of a real node with work in flight.

Every commanded transition the node implements is driven here on the `tiny_tcp_node` (prefill=2,
decode=3), with the state's behaviour checked through `status`, the results and the log:

- Decode → ShuttingDecode while sequences run: they finish (token-identical), no migration is admitted,
  then ShuttingNull (automatic); ShuttingNull → AusDecode → Decode: serves again;
- ShuttingNull → Inactive → LoadingDecode → Decode, and the same for a prefill replica;
- Prefill → ShuttingPrefill with prefilled requests waiting for a decode replica: they migrate and finish,
  new requests go to the other prefill replica, then ShuttingNull; AusPrefill → Prefill serves again;
- the whole node down to Inactive (weights released) and back with `scale`, where LoadingPrefill →
  NewPrefill (ZigZag) is refused `not_supported`;
- illegal moves get `invalid_transition` naming both states; ZigZag starts get `not_supported`.
(Prefill → MutatingToDecode → Decode is `test_flush.py`.)

Each test leaves the node as it found it: every replica serving, unlocked, idle.
"""

from __future__ import annotations

import pytest
import trio

from engine.client import ControlClient, ControlError
from messages.control import ReplicaStateName
from replicas.model import Model
from tests.node.harness import NodeProcess, by_name, wait_idle, wait_serving, wait_states, wait_status
from tests.node.workload import Outcome, assert_correct, distinct_asks, launch, reserved_blocks, send
from tests.waiting import deadline

DECODERS = ("decode-0", "decode-1", "decode-2")
PREFILLERS = ("prefill-0", "prefill-1")


async def transition(client: ControlClient, replica: str, to: ReplicaStateName, previous: str) -> None:
    with deadline(f"{replica}'s transition to {to}", 30):
        result = await client.transition(replica, to)
    assert (result.replica, result.previous, result.state) == (replica, previous, to)


def state_moves(node: NodeProcess, replica: str) -> list[tuple[str, str, str]]:
    return [
        (e["from"], e["to"], e["trigger"]) for e in node.events("replica_state") if e["replica"] == replica
    ]


async def serves_alone(client: ControlClient, model: Model, replica: str, *, offset: int) -> None:
    """With the other replicas of its role locked or shut, `replica` serves a request correctly."""
    outcome = await send(client, distinct_asks(1, max_tokens=3, offset=offset)[0])
    assert_correct(model, [outcome])
    (transfer,) = outcome.result.transfers
    assert replica in (transfer.source, transfer.destination), transfer


async def test_shutting_decode_finishes_its_sequences_admits_none_and_revives(
    tiny_tcp_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_tcp_node
    running = distinct_asks(4, max_tokens=40)
    later = distinct_asks(3, max_tokens=4, offset=10)
    first: list[Outcome] = []
    second: list[Outcome] = []
    async with node.client() as client:
        await wait_serving(client)
        await wait_idle(client)
        moves_before = len(state_moves(node, "decode-0"))
        await client.lock("decode-1")
        await client.lock("decode-2")
        async with trio.open_nursery() as nursery:
            launch(nursery, client, running, first)
            # All four decode on decode-0, the only unlocked decode replica.
            total = sum(reserved_blocks(ask) for ask in running)
            await wait_status(
                client,
                lambda s: by_name(s)["decode-0"].used_blocks == total,
                f"decode-0 holding {total} blocks",
            )
            await transition(client, "decode-0", "ShuttingDecode", "Decode")
            status = await client.status()
            assert by_name(status)["decode-0"].locked  # not Decode: accepts no migration
            # New requests find no decode replica that admits them: they wait on the prefill side.
            launch(nursery, client, later, second)
            await wait_status(
                client,
                lambda s: sum(by_name(s)[p].migration_queue for p in PREFILLERS) == len(later),
                "the new requests waiting in the prefill replicas' migration queues",
            )
            assert by_name(await client.status())["decode-0"].state in ("ShuttingDecode", "ShuttingNull")
            await client.unlock("decode-1")
            await client.unlock("decode-2")
        await wait_states(client, {"decode-0": "ShuttingNull"})
        assert_correct(tiny, first + second)
        assert {o.result.transfers[0].destination for o in first} == {"decode-0"}
        assert {o.result.transfers[0].destination for o in second} <= {"decode-1", "decode-2"}
        assert all(len(o.result.token_ids) == 40 for o in first)
        assert state_moves(node, "decode-0")[moves_before:] == [
            ("Decode", "ShuttingDecode", "command"),
            ("ShuttingDecode", "ShuttingNull", "automatic"),
        ]
        # The sequences were still running when the replica began shutting down.
        events = node.events("replica_state", "request_finished")
        shutting = max(
            i
            for i, e in enumerate(events)
            if e["event"] == "replica_state" and e["replica"] == "decode-0" and e["to"] == "ShuttingDecode"
        )
        ids = {o.result.request_id for o in first}
        assert ids <= {e["request_id"] for e in events[shutting:] if e["event"] == "request_finished"}

        # Revive with the weights still resident, and serve again.
        await transition(client, "decode-0", "AusDecode", "ShuttingNull")
        await wait_states(client, {"decode-0": "Decode"})
        assert state_moves(node, "decode-0")[-2:] == [
            ("ShuttingNull", "AusDecode", "command"),
            ("AusDecode", "Decode", "automatic"),
        ]
        await client.lock("decode-1")
        await client.lock("decode-2")
        await serves_alone(client, tiny, "decode-0", offset=20)
        await client.unlock("decode-1")
        await client.unlock("decode-2")
        await wait_idle(client)


async def test_decode_replica_through_inactive_and_loading(tiny_tcp_node: NodeProcess, tiny: Model) -> None:
    """decode-2 goes ShuttingDecode → ShuttingNull → Inactive → LoadingDecode → Decode while requests run
    on the node (some on decode-2 itself when it starts shutting down); they all finish correctly."""
    node = tiny_tcp_node
    background: list[Outcome] = []
    async with node.client() as client:
        await wait_serving(client)
        async with trio.open_nursery() as nursery:
            launch(nursery, client, distinct_asks(9, max_tokens=60, offset=30), background)
            await wait_status(
                client, lambda s: by_name(s)["decode-2"].used_blocks > 0, "requests decoding on decode-2"
            )
            await transition(client, "decode-2", "ShuttingDecode", "Decode")
            await wait_states(client, {"decode-2": "ShuttingNull"})
            await transition(client, "decode-2", "Inactive", "ShuttingNull")
            status = by_name(await client.status())["decode-2"]
            assert (status.state, status.used_blocks, status.locked) == ("Inactive", 0, True)
            await transition(client, "decode-2", "LoadingDecode", "Inactive")
            await wait_states(client, {"decode-2": "Decode"})
        assert_correct(tiny, background)
        assert "decode-2" in {o.result.transfers[0].destination for o in background}
        assert state_moves(node, "decode-2")[-5:] == [
            ("Decode", "ShuttingDecode", "command"),
            ("ShuttingDecode", "ShuttingNull", "automatic"),
            ("ShuttingNull", "Inactive", "command"),
            ("Inactive", "LoadingDecode", "command"),
            ("LoadingDecode", "Decode", "automatic"),
        ]
        await client.lock("decode-0")
        await client.lock("decode-1")
        await serves_alone(client, tiny, "decode-2", offset=39)
        await client.unlock("decode-0")
        await client.unlock("decode-1")
        await wait_idle(client)


async def test_shutting_prefill_migrates_what_it_prefilled_and_takes_no_new_work(
    tiny_tcp_node: NodeProcess, tiny: Model
) -> None:
    node = tiny_tcp_node
    waiting = distinct_asks(4, max_tokens=3, offset=40)
    later = distinct_asks(2, max_tokens=3, offset=50)
    first: list[Outcome] = []
    second: list[Outcome] = []
    async with node.client() as client:
        await wait_serving(client)
        await wait_idle(client)
        for decoder in DECODERS:
            await client.lock(decoder)
        async with trio.open_nursery() as nursery:
            launch(nursery, client, waiting, first)
            status = await wait_status(
                client,
                lambda s: sum(by_name(s)[p].migration_queue for p in PREFILLERS) == len(waiting),
                "every request prefilled and waiting for a decode replica",
            )
            shut, other = sorted(PREFILLERS, key=lambda p: -by_name(status)[p].migration_queue)
            held = by_name(status)[shut].migration_queue
            assert held > 0
            await transition(client, shut, "ShuttingPrefill", "Prefill")
            launch(nursery, client, later, second)
            await wait_status(
                client,
                lambda s: by_name(s)[other].migration_queue == len(waiting) - held + len(later),
                f"the new requests prefilled on {other}",
            )
            assert (
                by_name(await client.status())[shut].state == "ShuttingPrefill"
            )  # still holds its migrations
            for decoder in DECODERS:
                await client.unlock(decoder)
        await wait_states(client, {shut: "ShuttingNull"})
        assert_correct(tiny, first + second)
        sources = [o.result.transfers[0].source for o in first]
        assert sources.count(shut) == held
        assert {o.result.transfers[0].source for o in second} == {other}
        assert state_moves(node, shut)[-2:] == [
            ("Prefill", "ShuttingPrefill", "command"),
            ("ShuttingPrefill", "ShuttingNull", "automatic"),
        ]

        # Revive it; then, with the other one shut, it alone prefills.
        await transition(client, shut, "AusPrefill", "ShuttingNull")
        await wait_states(client, {shut: "Prefill"})
        await transition(client, other, "ShuttingPrefill", "Prefill")
        await wait_states(client, {other: "ShuttingNull"})
        await serves_alone(client, tiny, shut, offset=60)
        # The other one through Inactive and loading, serving again alone.
        await transition(client, other, "Inactive", "ShuttingNull")
        await transition(client, other, "LoadingPrefill", "Inactive")
        await wait_states(client, {other: "Prefill"})
        await transition(client, shut, "ShuttingPrefill", "Prefill")
        await wait_states(client, {shut: "ShuttingNull"})
        await serves_alone(client, tiny, other, offset=70)
        await transition(client, shut, "AusPrefill", "ShuttingNull")
        await wait_serving(client)
        await wait_idle(client)


ILLEGAL: list[tuple[str, ReplicaStateName, str]] = [
    (
        "decode-0",
        "Prefill",
        "decode-0: cannot move from Decode to Prefill; from Decode you can command: ShuttingDecode",
    ),
    (
        "prefill-0",
        "Decode",
        "prefill-0: cannot move from Prefill to Decode; "
        "from Prefill you can command: MutatingToDecode, OldPrefill, ShuttingPrefill",
    ),
    (
        "decode-1",
        "ShuttingNull",
        "decode-1: cannot move from Decode to ShuttingNull; from Decode you can command: ShuttingDecode",
    ),
    (
        "prefill-1",
        "Inactive",
        "prefill-1: cannot move from Prefill to Inactive; "
        "from Prefill you can command: MutatingToDecode, OldPrefill, ShuttingPrefill",
    ),
]


@pytest.mark.parametrize(("replica", "to", "message"), ILLEGAL)
async def test_illegal_moves_name_both_states(
    tiny_tcp_node: NodeProcess, replica: str, to: ReplicaStateName, message: str
) -> None:
    async with tiny_tcp_node.client() as client:
        await wait_serving(client)
        with pytest.raises(ControlError) as refused:
            await client.transition(replica, to)
        assert (refused.value.code, refused.value.message) == ("invalid_transition", message)
        assert by_name(await client.status())[replica].state in ("Prefill", "Decode")


async def test_automatic_moves_and_zigzag_starts_are_refused(tiny_tcp_node: NodeProcess) -> None:
    async with tiny_tcp_node.client() as client:
        await wait_serving(client)
        await transition(client, "decode-1", "ShuttingDecode", "Decode")
        await wait_states(client, {"decode-1": "ShuttingNull"})
        with pytest.raises(ControlError) as refused:
            await client.transition("decode-1", "Decode")
        assert (refused.value.code, refused.value.message) == (
            "invalid_transition",
            "decode-1: cannot move from ShuttingNull to Decode; "
            "from ShuttingNull you can command: AusDecode, AusPrefill, Inactive",
        )
        await transition(client, "decode-1", "AusDecode", "ShuttingNull")
        await wait_states(client, {"decode-1": "Decode"})
        with pytest.raises(ControlError) as refused:
            await client.transition("decode-1", "ShuttingNull")
        assert refused.value.code == "invalid_transition"
        with pytest.raises(ControlError) as refused:
            await client.transition("prefill-0", "OldPrefill")
        assert (refused.value.code, refused.value.message) == (
            "invalid_transition",
            "prefill-0: no NewPrefill replica to pair with as OldPrefill",
        )
        with pytest.raises(ControlError) as refused:
            await client.transition("decode-9", "Decode")
        assert refused.value.code == "not_found"
        assert "no replica 'decode-9'" in refused.value.message
        await wait_serving(client)


async def test_whole_node_to_inactive_and_back_with_scale(tiny_tcp_node: NodeProcess, tiny: Model) -> None:
    """Scale both roles to 0 (Shutting* → ShuttingNull), release every replica's weights (Inactive), catch
    a replica in LoadingPrefill to see NewPrefill refused (no serving prefill replica to pair it with),
    then scale back up; a generate sent while no
    replica serves waits in the queue and is served once they are back."""
    node = tiny_tcp_node
    async with node.client() as client:
        await wait_serving(client)
        await wait_idle(client)
        for role in ("decode", "prefill"):
            result = await client.scale(role, 0)
            assert (result.role, result.target, result.replicas) == (role, 0, [])
        await wait_states(client, {name: "ShuttingNull" for name in PREFILLERS + DECODERS})
        for name in PREFILLERS + DECODERS:
            await transition(client, name, "Inactive", "ShuttingNull")
        loads_before = len(node.events("weights_progress"))
        for _attempt in range(10):
            await transition(client, "prefill-0", "LoadingPrefill", "Inactive")
            try:
                await client.transition("prefill-0", "NewPrefill")
            except ControlError as refused:
                if refused.code == "bad_request":
                    assert refused.message == "prefill-0: no Prefill or OldPrefill replica to pair with"
                    break
                # The weights loaded before the command arrived: start again from Inactive.
                assert refused.message.startswith("prefill-0: cannot move from Prefill to NewPrefill")
                await transition(client, "prefill-0", "ShuttingPrefill", "Prefill")
                await wait_states(client, {"prefill-0": "ShuttingNull"})
                await transition(client, "prefill-0", "Inactive", "ShuttingNull")
        else:
            pytest.fail("never caught prefill-0 in LoadingPrefill")
        await wait_states(client, {"prefill-0": "Prefill"})
        assert len(node.events("weights_progress")) > loads_before  # released, then loaded again
        waiting: list[Outcome] = []
        async with trio.open_nursery() as nursery:
            launch(nursery, client, distinct_asks(2, max_tokens=3, offset=80), waiting)
            await wait_status(
                client,
                lambda s: by_name(s)["prefill-0"].migration_queue == 2,
                "the requests prefilled and waiting for a decode replica",
            )
            result = await client.scale("decode", 3)
            assert (result.target, sorted(result.replicas)) == (3, list(DECODERS))
            result = await client.scale("prefill", 2)
            assert (result.target, sorted(result.replicas)) == (2, list(PREFILLERS))
        assert_correct(tiny, waiting)
        await wait_serving(client)
        await wait_idle(client)


async def test_a_role_change_by_revival_needs_pools_that_serve_the_role(
    tiny_tcp_node: NodeProcess, tiny: Model
) -> None:
    """A prefill replica revived as a decode replica (AusDecode) serves as one; a decode replica has no
    embedding landing pool, so with the tiny model (which has a vision encoder) it cannot be revived as a
    prefill replica: refused, naming both states and why."""
    async with tiny_tcp_node.client() as client:
        await wait_serving(client)
        await transition(client, "prefill-1", "ShuttingPrefill", "Prefill")
        await wait_states(client, {"prefill-1": "ShuttingNull"})
        await transition(client, "prefill-1", "AusDecode", "ShuttingNull")
        status = await wait_states(client, {"prefill-1": "Decode"})
        assert (by_name(status)["prefill-1"].role, by_name(status)["prefill-1"].locked) == ("decode", False)
        for decoder in DECODERS:
            await client.lock(decoder)
        outcome = await send(client, distinct_asks(1, max_tokens=4, offset=90)[0])
        assert_correct(tiny, [outcome])
        assert (outcome.result.transfers[0].source, outcome.result.transfers[0].destination) == (
            "prefill-0",
            "prefill-1",
        )
        for decoder in DECODERS:
            await client.unlock(decoder)
        await transition(client, "prefill-1", "ShuttingDecode", "Decode")
        await wait_states(client, {"prefill-1": "ShuttingNull"})
        await transition(client, "prefill-1", "AusPrefill", "ShuttingNull")

        await transition(client, "decode-2", "ShuttingDecode", "Decode")
        shut = await wait_states(client, {"decode-2": "ShuttingNull"})
        source = by_name(shut)["decode-2"].weights_source
        with pytest.raises(ControlError) as refused:
            await client.transition("decode-2", "AusPrefill")
        assert (refused.value.code, refused.value.message) == (
            "invalid_transition",
            "decode-2: cannot move from ShuttingNull to AusPrefill: it has no embedding landing pool for the "
            "model's images, so it cannot serve prefill (it was configured as a decode replica)",
        )
        refused_status = by_name(await client.status())["decode-2"]
        assert (refused_status.state, refused_status.weights_source) == ("ShuttingNull", source)  # untouched
        await transition(client, "decode-2", "AusDecode", "ShuttingNull")
        await wait_serving(client)
        await wait_idle(client)
