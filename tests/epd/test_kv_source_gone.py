"""A decode replica asked to receive KV from a transfer endpoint that is gone (its prefill replica failed
and has not registered it again) fails that one request and serves on: `UnknownEndpoint` must not escape
the KV receive path and take down the decode replica with every request it is decoding.

A node served in the test's own trio run (`tests.epd.inprocess`), so the decode replica can be sent the
`ReserveKV` a prefill replica's migrator would send, naming an endpoint no replica has open.
"""

from __future__ import annotations

from pathlib import Path

import trio

from engine.client import ControlClient
from messages.commands import ReserveKV
from replicas.inbox import new_command_id
from replicas.model import Model, SamplingParams
from replicas.request import FailedUpdate, RequestSpec, ServingRequest
from tests.epd.inprocess import served_node
from tests.epd.node import wait_serving
from tests.waiting import deadline, wait_until


async def test_a_kv_source_that_is_gone_fails_its_request_and_the_decode_replica_serves_on(
    tmp_path: Path, tiny: Model
) -> None:
    async with served_node(tmp_path) as served, ControlClient.connect(served.address) as client:
        await wait_serving(client)
        router = served.node.router
        decode = next(
            replica for replica in served.node.directory.local() if replica.name.startswith("decode")
        )
        lived: list[int] = []

        async def generate() -> None:
            with deadline("the reply to the long request", 60):
                result = await client.generate_result(prompt="a long answer", max_tokens=200, ignore_eos=True)
            lived.append(len(result.token_ids))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate)
            await wait_until(
                lambda: decode.snapshot().decoding, "the long request decoding", 60, interval=0.005
            )
            victim = ServingRequest(
                RequestSpec.of(
                    request_id="orphan",
                    prompt_ids=list(range(5, 25)),
                    images=[],
                    sampling=SamplingParams(),
                    max_tokens=4,
                ),
                eos_token_ids=[],
            )
            router.requests[victim.request_id] = victim
            reserve = ReserveKV(
                command_id=new_command_id(),
                request_id=victim.request_id,
                transfer_id="orphan/kv",
                source_endpoint="prefill-9/kv",
                prompt_tokens=20,
                capacity_tokens=24,
            )
            await decode.ask(reserve)
            await wait_until(
                lambda: victim.final_update is not None,
                "the orphan request's final update",
                10,
                interval=0.005,
            )
            assert not lived  # still decoding when the orphan failed beside it
            del router.requests[victim.request_id]  # what the router does for the requests it admits
        assert isinstance(victim.final_update, FailedUpdate)
        assert victim.final_update.code == "transfer_failed"
        assert victim.final_update.message == (
            "KV migration of request orphan failed: transfer endpoint 'prefill-9/kv' is not open"
        )
        assert lived == [200]
        assert decode.state.value == "Decode" and decode.last_error is None
        assert not served.events("replica_failed")
