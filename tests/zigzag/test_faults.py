"""ZigZag under faults, through a real node: a replica of the episode failing, a request cancelled while
relayed. Whatever the moment of the fault, every request ends — correct, or with a clear error code —
every block returns to its pool (`used_blocks` 0 once idle), the replicas end in defined states and the
node keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from engine.client import ControlClient, ControlError
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
from tests.node.workload import Ask, Outcome, check_outcome, mixed_workload, send, still_serving

ERROR_CODES = frozenset({"replica_failed", "transfer_failed", "transfer_timeout", "overloaded"})


async def episode_with_load(
    client: ControlClient, model: Model, count: int
) -> tuple[list[Outcome], list[str]]:
    """Scale prefill to 2 (ZigZag) once the new replica can take batches, send `count` requests; returns
    the outcomes that completed and the error codes of the others."""
    result = await client.scale("prefill", 2, mode="zigzag", source="host")
    new = result.started[0].replica
    await wait_status(
        client,
        lambda s: by_name(s)[new].state != "NewPrefill" or by_name(s)[new].weights_bytes_loaded > 0,
        f"{new} taking batches",
    )
    outcomes: list[Outcome] = []
    errors: list[str] = []

    async def one(ask: Ask) -> None:
        try:
            outcomes.append(await send(client, ask))
        except ControlError as exc:
            assert exc.code in ERROR_CODES, f"unexpected error {exc.code}: {exc.message}"
            assert exc.message, "an error without a message"
            errors.append(exc.code)

    async with trio.open_nursery() as nursery:
        for ask in mixed_workload(model, count, text=True, seed=7):
            nursery.start_soon(one, ask)
    return outcomes, errors


@pytest.mark.parametrize("failing", ["prefill-1", "prefill-0", "decode-0"])
async def test_a_replica_of_the_episode_failing(tmp_path: Path, tiny: Model, failing: str) -> None:
    """`prefill-1` is the NewPrefill, `prefill-0` its OldPrefill, `decode-0` receives both KV halves."""
    with node_process(
        tmp_path,
        "--replicas",
        "prefill=1,decode=1",
        "--migration-wait",
        "3",
        "--fault",
        "hold_weights:before_layer=2,seconds=600,nth=1",
        "--fault",
        f"fail_replica:replica={failing},after_steps=25",
    ) as node:
        async with node.client() as client:
            await wait_serving(client)
            async with trio.open_nursery() as nursery:
                # The copy is held until the failure struck (or the load ended), then let go (`release`).
                nursery.start_soon(release_once_failed, client, failing)
                outcomes, _errors = await episode_with_load(client, tiny, 24)
                nursery.cancel_scope.cancel()
            await client.release()
            problems = [
                p for outcome in outcomes for p in check_outcome(tiny, outcome, transport=default_transport())
            ]
            assert not problems, "\n".join(problems)
            await wait_states(client, {"prefill-0": frozenset({"Prefill", "Inactive"})})
            status = await wait_idle(client)
            assert all(replica.used_blocks == 0 for replica in status.replicas)
        assert node.events("fault_injected")
        for replica in ("prefill-0", "prefill-1", "decode-0"):
            if replica != failing:
                async with node.client() as client:
                    await wait_states(client, {replica: frozenset({"Prefill", "Decode"})})
        async with node.client() as client:
            if by_name(await client.status())[failing].state == "Inactive":
                await client.transition(
                    failing, "LoadingDecode" if failing.startswith("decode") else "LoadingPrefill"
                )
        await still_serving(node, tiny, offset=60, transport=default_transport())


async def release_once_failed(client: ControlClient, failing: str) -> None:
    def failed(status: StatusResult) -> bool:  # (prefill-1 is made by the scale)
        replica = by_name(status).get(failing)
        return replica is not None and replica.last_error is not None

    await wait_status(client, failed, f"{failing} failing")
    await client.release()


async def test_requests_cancelled_while_relayed(tmp_path: Path, tiny: Model) -> None:
    with node_process(
        tmp_path, "--replicas", "prefill=1,decode=1", "--fault", "hold_weights:before_layer=1,seconds=600"
    ) as node:
        async with node.client() as client:
            await wait_serving(client)
            result = await client.scale("prefill", 2, mode="zigzag")
            new = result.started[0].replica
            await wait_status(
                client,
                lambda s: by_name(s)[new].loaded_layers == 1,
                f"{new} holding one layer",
            )
            asks = [
                Ask(input_ids=tuple(range(3, 3 + 20 + i)), max_tokens=40, ignore_eos=True) for i in range(8)
            ]
            ended: list[str] = []

            async def one(index: int) -> None:
                outcome = await send(client, asks[index], request_id=f"cancel-me-{index}")
                ended.append(outcome.result.finish_reason)

            async with trio.open_nursery() as nursery:
                for index in range(len(asks)):
                    nursery.start_soon(one, index)
                await wait_status(
                    client, lambda s: by_name(s)["prefill-0"].state == "OldPrefill", "the episode running"
                )
                for index in range(len(asks)):
                    try:
                        await client.cancel(f"cancel-me-{index}")
                    except ControlError as exc:
                        assert exc.code == "not_found"  # it had finished already
            assert set(ended) <= {"cancelled", "length"} and "cancelled" in ended
            assert (await client.release()).released == 1
            status = await wait_idle(client)
            assert all(replica.used_blocks == 0 for replica in status.replicas)
        await still_serving(node, tiny, offset=70, transport=default_transport())
