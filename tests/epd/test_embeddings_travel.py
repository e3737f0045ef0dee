"""The embeddings really travel: the language side never runs the vision encoder, and what it prefills
is what landed — altering the landed embeddings (the `corrupt_transfer` hook) changes the output.

Nodes served in the test's own trio run (`tests.epd.inprocess`), over their real control sockets, so the
vision encoder's call counter can be read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import trio

from engine.client import ControlClient
from messages.control_replies import GenerateResult
from replicas.model import Model
from tests.epd.images import image_input, image_with_rows, reference
from tests.epd.inprocess import served_node
from tests.epd.node import wait_blocks_returned, wait_serving
from tests.waiting import deadline

MAX_TOKENS = 5


async def _generate(client: ControlClient, prompt: str, images: list[np.ndarray]) -> GenerateResult:
    with deadline(f"the reply to {prompt!r}", 60):
        return await client.generate_result(
            prompt=prompt,
            images=[image_input(image) for image in images],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )


async def test_the_prefill_replica_never_runs_the_vision_encoder(tmp_path: Path, tiny: Model) -> None:
    requests = [
        ("<image> one", [image_with_rows(64, 1)]),
        ("<image> and <image>", [image_with_rows(96, 2), image_with_rows(1100, 3)]),
        ("three <image>", [image_with_rows(300, 4)]),
        ("text only", []),
    ]
    results: dict[int, GenerateResult] = {}
    async with served_node(tmp_path) as served, ControlClient.connect(served.address) as client:
        await wait_serving(client)
        model = served.node.host.loaded
        assert model is not None and model.vision is not None
        calls, images = model.vision.invocations, model.vision.images_encoded

        async def one(index: int, prompt: str, images: list[np.ndarray]) -> None:
            results[index] = await _generate(client, prompt, images)

        async with trio.open_nursery() as nursery:
            for index, (prompt, request_images) in enumerate(requests):
                nursery.start_soon(one, index, prompt, request_images)
        # One encoder call per image request, all on the encode replica: none on the language side.
        assert model.vision.invocations - calls == 3
        assert model.vision.images_encoded - images == 4
        await wait_blocks_returned(client)
        encode_events = served.events("encode_started", "encode_finished")
    assert len(encode_events) == 6 and {event["replica"] for event in encode_events} == {"encode-0"}
    for index, (prompt, request_images) in enumerate(requests):
        assert results[index].token_ids == reference(tiny, prompt, request_images, MAX_TOKENS)
    assert [transfer.kind for transfer in results[1].transfers] == ["embedding", "kv"]


async def test_altering_the_landed_embeddings_changes_the_output(tmp_path: Path, tiny: Model) -> None:
    prompt, images = "<image> what is this?", [image_with_rows(1100, 7)]
    expected = reference(tiny, prompt, images, MAX_TOKENS)
    fault = "corrupt_transfer:transfer=embedding,nth=0"
    async with (
        served_node(tmp_path, "--fault", fault) as served,
        ControlClient.connect(served.address) as client,
    ):
        await wait_serving(client)
        altered = await _generate(client, prompt, images)  # the first embedding transfer: altered
        clean = await _generate(client, prompt, images)  # the second: as sent
        text = await _generate(client, "text is not touched", [])
        await wait_blocks_returned(client)
        faults = served.events("fault_injected")
    assert altered.token_ids != expected
    assert clean.token_ids == expected
    assert text.token_ids == reference(tiny, "text is not touched", [], MAX_TOKENS)
    assert [(event["fault"], event["replica"]) for event in faults] == [("corrupt_transfer", "prefill-0")]
