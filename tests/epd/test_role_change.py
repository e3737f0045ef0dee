"""A prefill replica told to become a decode replica while an image request's embeddings land on it.

It finishes receiving (the rows are on their way into its pool), then hands the laid-out request back
to the router, which gives it to the other prefill replica: the output is the model's own, and the
replica ends in `Decode` (real node process: encode=1, prefill=2, decode=1; encode-0 waits 1.5 s before
writing round 0, so the change of role comes while the transfer is open).
"""

from __future__ import annotations

from pathlib import Path

import trio

from engine.client import ControlClient
from messages.control_replies import GenerateResult
from replicas.model import Model
from tests.epd.images import image_input, image_with_rows, reference
from tests.epd.node import start_nodes, wait_blocks_returned, wait_serving, wait_states
from tests.waiting import deadline, wait_until

PROMPT = "<image> changing hands"


async def test_embeddings_landing_on_a_replica_that_changes_role(tmp_path: Path, tiny: Model) -> None:
    options = [
        "--replicas",
        "encode=1,prefill=2,decode=1",
        "--fault",
        "stall_sender:replica=encode-0,seconds=1.5",
    ]
    image = image_with_rows(1200, 12)
    with start_nodes(tmp_path, {"mutating": options}) as nodes:
        node = nodes["mutating"]
        async with node.client() as client:
            await wait_serving(client)
            result: list[GenerateResult] = []

            async def generate(client: ControlClient) -> None:
                with deadline("the reply to the image request", 60):
                    result.append(
                        await client.generate_result(
                            prompt=PROMPT, images=[image_input(image)], max_tokens=4, ignore_eos=True
                        )
                    )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate, client)
                await wait_until(
                    lambda: node.events("transfer_started"), "the embeddings' transfer starting", 60
                )
                with deadline("prefill-0's transition to MutatingToDecode", 60):
                    await client.transition("prefill-0", "MutatingToDecode")
            await wait_states(client, {"prefill-0": frozenset({"Decode"})})
            await wait_blocks_returned(client)
    (done,) = result
    embedding, kv = done.transfers
    assert (embedding.kind, embedding.destination, embedding.rounds) == ("embedding", "prefill-0", 2)
    assert (kv.kind, kv.source) == ("kv", "prefill-1")
    assert done.token_ids == reference(tiny, PROMPT, [image], 4)
