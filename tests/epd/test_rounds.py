"""Image requests through real nodes: REQUEST_MORE_CACHE rounds, and the same output whatever the grant.

Three node processes (tiny model, encode=1 prefill=1 decode=1), started together by the one test here
(one test, so that pytest-xdist never starts them twice):

- `n8`: the defaults — 128-token embedding blocks, a default grant of 8 blocks (1024 tokens), inproc;
- `n1`: a default grant of 1 block, at most 1 block per REQUEST_MORE_CACHE round, a language-side
  embedding pool of 4 blocks (512 tokens: smaller than one request's embeddings), over loopback TCP;
- `n100`: a default grant of 100 blocks (12 800 tokens: every image here fits round 0), inproc.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from engine.client import ControlClient
from messages.control_replies import GenerateResult
from replicas.model import Model
from tests.epd.images import image_input, image_with_rows, reference
from tests.epd.node import Node, start_nodes, wait_blocks_returned, wait_serving
from tests.node.harness import default_transport
from tests.waiting import deadline

BYTES_PER_ROW = 128 * 4 + 8 + 3 * 8  # embeds [128] float32, token_ids int64, positions [3] int64
MAX_TOKENS = 6


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    options = {
        "n8": [],
        "n1": [
            *("--transport", "tcp"),
            *("--embedding-default-blocks", "1"),
            *("--embedding-max-grant-blocks", "1"),
            *("--embedding-pool-blocks", "4"),
        ],
        "n100": ["--embedding-default-blocks", "100"],
    }
    with start_nodes(tmp_path, options) as started:
        yield started


async def _generate_all(
    client: ControlClient, requests: list[tuple[str, list[np.ndarray]]]
) -> list[GenerateResult]:
    results: list[GenerateResult | None] = [None] * len(requests)

    async def one(index: int, prompt: str, images: list[np.ndarray]) -> None:
        results[index] = await client.generate_result(
            prompt=prompt,
            images=[image_input(image) for image in images],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )

    with deadline(f"the replies to {len(requests)} concurrent requests", 120):
        async with trio.open_nursery() as nursery:
            for index, (prompt, images) in enumerate(requests):
                nursery.start_soon(one, index, prompt, images)
    assert all(result is not None for result in results)
    return [result for result in results if result is not None]


def _embedding_rounds(result: GenerateResult) -> int:
    (embedding,) = [transfer for transfer in result.transfers if transfer.kind == "embedding"]
    return embedding.rounds


@pytest.mark.slow
async def test_rounds_and_the_same_output_whatever_the_default_grant(
    nodes: dict[str, Node], tiny: Model
) -> None:
    await _check_rounds_against_the_default_grant(nodes["n8"], tiny)
    await _check_the_same_output_whatever_the_grant(nodes, tiny)


async def _check_rounds_against_the_default_grant(node: Node, tiny: Model) -> None:
    """500, 1024, 2000 and 10 000 embedding tokens against the 1024-token default: 1, 1, 2, >= 2 rounds."""
    rows = [500, 1024, 2000, 10_000]
    requests = [(f"<image> picture of {n} rows", [image_with_rows(n, seed=n)]) for n in rows]
    requests += [("a text request in between", []), ("another one", [])]
    async with node.client() as client:
        await wait_serving(client)
        results = await _generate_all(client, requests)
        await wait_blocks_returned(client)

    rounds = [_embedding_rounds(result) for result in results[:4]]
    assert rounds[:3] == [1, 1, 2] and rounds[3] >= 2
    for result, n in zip(results, rows):
        embedding, kv = result.transfers
        assert (embedding.kind, embedding.source, embedding.destination) == (
            "embedding",
            "encode-0",
            "prefill-0",
        )
        assert embedding.bytes == n * BYTES_PER_ROW and embedding.transport == default_transport()
        assert kv.kind == "kv" and result.prompt_tokens == n + len(f" picture of {n} rows") + 1
        assert result.timings.encode_s is not None and result.timings.embedding_transfer_s is not None
    for result in results[4:]:
        assert [transfer.kind for transfer in result.transfers] == ["kv"]
    for result, (prompt, images) in zip(results, requests):
        assert result.token_ids == reference(tiny, prompt, images, MAX_TOKENS), prompt

    # The log says the same: the default grant went out before the length was known, and every row
    # arrived in `transfer_round`s that add up to the image.
    started = {e["transfer_id"]: e for e in node.events("transfer_started") if e["kind"] == "embedding"}
    landed: dict[str, int] = {}
    for event in node.events("transfer_round"):
        if event["kind"] == "embedding":
            landed[event["transfer_id"]] = landed.get(event["transfer_id"], 0) + event["tokens"]
    for result, n in zip(results, rows):
        transfer_id = result.transfers[0].transfer_id
        assert started[transfer_id]["total_tokens"] is None and started[transfer_id]["granted_blocks"] == 8
        assert landed[transfer_id] == n
    encoded = sorted(e["tokens"] for e in node.events("encode_finished"))
    assert encoded == rows and {e["replica"] for e in node.events("encode_started")} == {"encode-0"}


async def _check_the_same_output_whatever_the_grant(nodes: dict[str, Node], tiny: Model) -> None:
    """Grants of 1 (over tcp, a landing pool smaller than a request), 8 and 100 blocks: the same tokens,
    and the model's own in one piece."""
    requests = [
        ("<image> on the left, <image> on the right", [image_with_rows(500, 1), image_with_rows(1024, 2)]),
        ("what is in the picture?", [image_with_rows(2000, 3)]),  # no placeholder: the image goes first
        ("plain text", []),
    ]
    outputs: dict[str, list[list[int]]] = {}
    rounds: dict[str, list[int]] = {}
    landing_blocks: dict[str, int] = {}
    for name in ("n1", "n8", "n100"):
        async with nodes[name].client() as client:
            status = await wait_serving(client)
            landing_blocks[name] = next(r.total_blocks for r in status.replicas if r.name == "prefill-0")
            results = await _generate_all(client, requests)
            await wait_blocks_returned(client)
        outputs[name] = [result.token_ids for result in results]
        rounds[name] = [_embedding_rounds(result) for result in results[:2]]
        transports = {transfer.transport for result in results for transfer in result.transfers}
        assert transports == {"tcp" if name == "n1" else default_transport()}
    assert rounds == {"n1": [12, 16], "n8": [2, 2], "n100": [1, 1]}
    expected = [reference(tiny, prompt, images, MAX_TOKENS) for prompt, images in requests]
    assert outputs["n1"] == outputs["n8"] == outputs["n100"] == expected
    # n1's landing pool (4 blocks of 128) is smaller than either image request's embeddings; the others
    # hold one maximum-context request (256 blocks). Beside them: 2048 KV blocks.
    assert landing_blocks == {"n1": 2048 + 4, "n8": 2048 + 256, "n100": 2048 + 256}
