"""Chunked prefill through a real node: prompts longer than `--prefill-chunk-tokens` run in chunks, other
requests' between them, and every output equals the model run in one piece (`engine.verify.compare`);
a short request sent while a long prompt is being prefilled gets its tokens before the long one gets
its first."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from messages.grammar import RegexGrammar
from replicas.model import Model, SamplingParams, generate_in_one_piece
from tests.epd.images import image_input, image_with_rows, reference
from tests.node.harness import NodeProcess, default_transport, node_process, wait_idle, wait_serving
from tests.node.test_identity import assert_identical, assert_only_prefill_replicas_ran_prompts
from tests.node.workload import Ask, Outcome, check_outcome, mixed_workload, send, send_all
from tests.waiting import deadline

CHUNK = 16


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """The tiny model in chunks of 16 tokens, 64 per batch; each batch padded to 4000 prompt tokens per
    second (`--emulated-speed`), so that a long prompt takes long enough for a request to come meanwhile."""
    directory: Path = tmp_path_factory.mktemp("chunked")
    options = ("--replicas", "encode=1,prefill=1,decode=1", "--max-batch-tokens", "64")
    speed = ("--emulated-speed", "prefill_tokens_per_s=4000")
    with node_process(directory, *options, "--prefill-chunk-tokens", str(CHUNK), *speed) as node:
        yield node


async def test_chunked_prompts_are_token_identical(chunked: NodeProcess, tiny: Model) -> None:
    """32 concurrent requests of 1 to 130 tokens, greedy and seeded: most run in several chunks."""
    asks = mixed_workload(tiny, 32, text=True, seed=5)
    async with chunked.client() as client:
        await wait_serving(client)
        outcomes = await send_all(client, asks)
        await wait_idle(client)
    assert_identical(tiny, outcomes, transport=default_transport())
    assert_only_prefill_replicas_ran_prompts(chunked, outcomes)  # once each, whatever its chunks
    assert sum(1 for outcome in outcomes if outcome.result.prompt_tokens > CHUNK) >= 10


async def test_a_short_request_passes_a_long_prompt_in_prefill(chunked: NodeProcess, tiny: Model) -> None:
    """1200 tokens take 75 chunks (0.3 s at the emulated speed): a 4-token request sent once the long
    one started ends first (each ends with its first token, on the prefill replica), and both equal the
    model run in one piece. Unchunked, the long prompt would run whole and end first."""
    asks = {
        "long": Ask(input_ids=tuple(3 + i % 200 for i in range(1200)), max_tokens=1, ignore_eos=True),
        "short": Ask(input_ids=(5, 6, 7, 8), max_tokens=1, ignore_eos=True),
    }
    outcomes: list[Outcome] = []
    async with chunked.client() as client, trio.open_nursery() as nursery:
        await wait_serving(client)

        async def run(name: str) -> None:
            outcomes.append(await send(client, asks[name], request_id=f"{name}-{id(outcomes)}"))

        nursery.start_soon(run, "long")
        await chunked.wait_event("prefill_started", lambda e: e["request_id"].startswith("long-"), timeout=30)
        nursery.start_soon(run, "short")
    assert [outcome.ask for outcome in outcomes] == [asks["short"], asks["long"]]
    for outcome in outcomes:
        assert check_outcome(tiny, outcome, transport=default_transport(), kv_moves=False) == []


async def test_a_chunk_boundary_inside_an_image_is_token_identical(chunked: NodeProcess, tiny: Model) -> None:
    """Image rows (their embeddings and 3-D positions) split across chunks of 16 tokens."""
    prompt = "two <image> and <image>"
    images = [image_with_rows(12, seed=1), image_with_rows(40, seed=2)]
    async with chunked.client() as client:
        await wait_serving(client)
        with deadline("the reply to an image request", 60):
            result = await client.generate_result(
                prompt=prompt, images=[image_input(image) for image in images], max_tokens=6, ignore_eos=True
            )
        await wait_idle(client)
    assert result.prompt_tokens > 3 * CHUNK
    assert result.token_ids == reference(tiny, prompt, images, 6)


async def test_a_structured_output_over_chunks_is_token_identical(chunked: NodeProcess, tiny: Model) -> None:
    """A regex-constrained request whose 70-token prompt runs in 5 chunks: only the last chunk's token is
    masked and fed to the grammar; the answer is the model run in one piece under the same grammar."""
    grammar = RegexGrammar(pattern=r"(zig|zag)-[0-9]{2,4}")
    prompt = [3 + (7 * i) % 200 for i in range(70)]
    async with chunked.client() as client:
        await wait_serving(client)
        with deadline("the reply to a structured request", 60):
            result = await client.generate_result(
                input_ids=prompt, max_tokens=12, seed=3, temperature=1.0, grammar=grammar
            )
        await wait_idle(client)
    sampling = SamplingParams(temperature=1.0, seed=3, grammar=grammar)
    assert result.token_ids == generate_in_one_piece(tiny, prompt, max_tokens=12, sampling=sampling)
    assert re.fullmatch(grammar.pattern, result.text) and result.finish_reason == "stop", result.text
