"""An encode replica that dies or raises mid-transfer (real node processes, one per test).

The request whose embeddings were in flight fails with `transfer_failed` or `replica_failed`; the
language replica's blocks come back (quarantined ones after their fence: the link's end, architecture §5.7);
requests that do not depend on that encode replica are unaffected; and the node still exits 0 (no leak).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from engine.client import ControlClient, ControlError
from messages.control_replies import GenerateResult
from replicas.model import Model
from tests.epd.images import image_input, image_with_rows, reference
from tests.epd.node import Node, start_nodes, wait_blocks_returned, wait_serving, wait_states
from tests.waiting import deadline

MAX_TOKENS = 4
STEP_TIMEOUT = 60.0
DOOMED = "doomed-image"


@pytest.fixture
def dying_link_node(tmp_path: Path) -> Iterator[Node]:
    # encode-0's links are torn down once 300 000 bulk bytes crossed one: in the middle of round 0 of a
    # 2000-row image (1 088 000 bytes), never for a 64-row one (34 816 bytes).
    fault = "drop_link:source=encode-0,destination=prefill-0,after_bytes=300000"
    with start_nodes(tmp_path, {"dying": ["--transport", "tcp", "--fault", fault]}) as nodes:
        yield nodes["dying"]


@pytest.fixture
def raising_node(tmp_path: Path) -> Iterator[Node]:
    # 16-row embedding blocks, one per grant: a 2000-row image takes 125 rounds, each a REQUEST_MORE_CACHE
    # through encode-0's command channel (one step of its loop); the fault fires at step 40, mid-transfer.
    options = [
        *("--embedding-block-size", "16"),
        *("--embedding-default-blocks", "1"),
        *("--embedding-max-grant-blocks", "1"),
        *("--fault", "fail_replica:replica=encode-0,after_steps=40"),
    ]
    with start_nodes(tmp_path, {"raising": options}) as nodes:
        yield nodes["raising"]


async def _generate(
    client: ControlClient, prompt: str, rows: list[int], request_id: str | None = None
) -> GenerateResult:
    images = [image_input(image_with_rows(n, seed=n)) for n in rows]
    with deadline(f"the reply to {prompt!r}", STEP_TIMEOUT):
        return await client.generate_result(
            prompt=prompt, images=images, max_tokens=MAX_TOKENS, ignore_eos=True, request_id=request_id
        )


async def _failing_with_text_beside(
    client: ControlClient, text_results: dict[int, GenerateResult]
) -> ControlError:
    """Send the 2000-row image request and, meanwhile, three text requests; return the image's error."""
    failure: list[ControlError] = []

    async def image() -> None:
        with pytest.raises(ControlError) as caught:
            await _generate(client, "<image> doomed", [2000], request_id=DOOMED)
        failure.append(caught.value)

    async def text(index: int) -> None:
        text_results[index] = await _generate(client, f"text {index} beside the image", [])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(image)
        for index in range(3):
            nursery.start_soon(text, index)
    return failure[0]


def _embedding_transfer(node: Node, request_id: str) -> dict[str, Any]:
    (finished,) = [
        event
        for event in node.events("transfer_finished")
        if event["kind"] == "embedding" and event["request_id"] == request_id
    ]
    return finished


async def test_an_encode_replica_whose_link_dies_mid_transfer(dying_link_node: Node, tiny: Model) -> None:
    node = dying_link_node
    text_results: dict[int, GenerateResult] = {}
    async with node.client() as client:
        await wait_serving(client)
        error = await _failing_with_text_beside(client, text_results)
        assert error.code == "transfer_failed" and "link_lost" in str(error)
        await wait_blocks_returned(client)
        small = await _generate(client, "<image> a small one", [64])  # a new link; this one is not cut
    finished = _embedding_transfer(node, DOOMED)
    assert finished["status"] == "failed" and finished["reason"] == "link_lost"
    assert sorted(text_results) == [0, 1, 2]
    for index, result in text_results.items():
        assert result.token_ids == reference(tiny, f"text {index} beside the image", [], MAX_TOKENS)
    assert small.token_ids == reference(tiny, "<image> a small one", [image_with_rows(64, 64)], MAX_TOKENS)


async def test_an_encode_replica_that_raises_mid_transfer(raising_node: Node, tiny: Model) -> None:
    node = raising_node
    text_results: dict[int, GenerateResult] = {}
    async with node.client() as client:
        await wait_serving(client)
        error = await _failing_with_text_beside(client, text_results)
        assert error.code in ("replica_failed", "transfer_failed"), error
        await wait_blocks_returned(client)
        # The request can fail (its transfer) before encode-0's task has finished closing its endpoints
        # and its supervisor marked it: over ucx that teardown takes a few progress rounds.
        status = await wait_states(client, {"encode-0": "Inactive"})
        encode = next(replica for replica in status.replicas if replica.name == "encode-0")
        assert "injected failure" in (encode.last_error or "")

        # With no encode replica serving, an image request waits while text requests go ahead.
        async with trio.open_nursery() as nursery:
            waiting: list[GenerateResult] = []

            async def image() -> None:
                waiting.append(await _generate(client, "<image> after the restart", [300]))

            nursery.start_soon(image)
            passing = await _generate(client, "text passes the waiting image", [])
            assert not waiting
            with deadline("encode-0's transition to LoadingEncode", STEP_TIMEOUT):
                await client.transition("encode-0", "LoadingEncode")
            await wait_states(client, {"encode-0": frozenset({"Encode"})})
        await wait_blocks_returned(client)

    finished = _embedding_transfer(node, DOOMED)
    assert finished["status"] == "failed" and 0 < finished["tokens"] < 2000
    assert sorted(text_results) == [0, 1, 2]
    for index, result in text_results.items():
        assert result.token_ids == reference(tiny, f"text {index} beside the image", [], MAX_TOKENS)
    assert passing.token_ids == reference(tiny, "text passes the waiting image", [], MAX_TOKENS)
    assert waiting[0].token_ids == reference(
        tiny, "<image> after the restart", [image_with_rows(300, 300)], MAX_TOKENS
    )
