"""Log-probabilities through a real node serving an HF checkpoint, against transformers' log-softmax of
the same model's logits (float32, to 1e-4): completions with `echo` (the prompt's, the first null) and
`logprobs`, streamed or not, chat with `top_logprobs` under seeded sampling, streamed chunks, and the control socket's
`generate`. The node runs a prefill and a decode replica: the first token's log-probability comes from
the prefill replica, the others' from the decode replica; a prompt longer than the node's prefill chunk
has its tokens scored across the chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tokenizers import Tokenizer

from tests.model.helpers import build_hf_model
from tests.node.harness import NodeProcess, node_process, wait_serving
from tests.waiting import wait_until

TOLERANCE = 1e-4
PROMPT_IDS = [5, 6, 7, 8, 5, 9, 3, 4, 10, 11, 3, 200, 17, 301]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, Any, Path]]:
    root: Path = tmp_path_factory.mktemp("logprobs")
    checkpoint = root / "llama"
    hf = build_hf_model("llama", checkpoint, seed=3)
    template = root / "chat.jinja"
    template.write_text(TEMPLATE)
    options = (
        "--model",
        str(checkpoint),
        "--chat-template",
        str(template),
        "--replicas",
        "prefill=1,decode=1",
    )
    with node_process(root, *options) as node:
        yield node, hf, checkpoint


@pytest.fixture
async def client(served: tuple[NodeProcess, Any, Path]) -> AsyncIterator[openai.AsyncOpenAI]:
    node = served[0]
    async with openai.AsyncOpenAI(
        base_url=f"{node.http_url}/v1", api_key="-", max_retries=0, timeout=60
    ) as api:

        async def healthy() -> bool:
            try:
                await api.models.list()
            except openai.APIError:
                return False
            return True

        await wait_until(healthy, "the node's API to answer", 60, interval=0.1)
        async with node.client() as control:
            await wait_serving(control)
        yield api


def reference(hf: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the model's logits, float32: row i scores the token after i."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


async def test_echo_and_logprobs_on_completions_equal_transformers(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any, Path]
) -> None:
    node, hf, _ = served
    name = (await client.models.list()).data[0].id
    reply = await client.completions.create(
        model=name, prompt=PROMPT_IDS, max_tokens=6, temperature=0, echo=True, logprobs=3
    )
    choice = reply.choices[0]
    scores = choice.logprobs
    assert scores is not None and scores.token_logprobs is not None and scores.top_logprobs is not None
    async with node.client() as control:
        result = await control.generate_result(input_ids=PROMPT_IDS, max_tokens=6, ignore_eos=True)
    tokens = PROMPT_IDS + result.token_ids
    expected = reference(hf, tokens)
    assert len(scores.token_logprobs) == len(tokens) and scores.token_logprobs[0] is None
    assert scores.top_logprobs[0] is None
    for index in range(1, len(tokens)):
        row = expected[index - 1]
        assert abs(scores.token_logprobs[index] - float(row[tokens[index]])) < TOLERANCE, index
        # Keyed by the token's text: ids that decode alike (here, ids past the tokenizer's words) share a key.
        best = row.topk(3).values
        values = list(scores.top_logprobs[index].values())
        assert abs(values[0] - float(best[0])) < TOLERANCE, index
        assert all(torch.isclose(best, torch.tensor(v), atol=TOLERANCE).any() for v in values), index
    words = Tokenizer.from_file(str(served[2] / "tokenizer.json"))
    assert choice.text.startswith(words.decode(PROMPT_IDS))  # the prompt's text comes first
    assert scores.text_offset == [len("".join(scores.tokens[:i])) for i in range(len(tokens))]
    plain = await client.completions.create(
        model=name, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=0
    )
    assert plain.choices[0].logprobs is not None
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(scores.token_logprobs[len(PROMPT_IDS) :])
    stream = await client.completions.create(
        model=name, prompt=PROMPT_IDS, max_tokens=6, temperature=0, echo=True, logprobs=3, stream=True
    )
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert "".join(chunk.text for chunk in chunks) == choice.text  # the prompt's chunk first
    streamed = [
        v for c in chunks if c.logprobs and c.logprobs.token_logprobs for v in c.logprobs.token_logprobs
    ]
    assert streamed == scores.token_logprobs


async def test_chat_top_logprobs_under_seeded_sampling_equal_transformers(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any, Path]
) -> None:
    """The raw distribution, whatever temperature and top-p did; the socket and a stream agree."""
    node, hf, checkpoint = served
    name = (await client.models.list()).data[0].id
    words = "the cat sat on the mat zig zag"
    options: dict[str, Any] = dict(
        model=name,
        messages=[{"role": "user", "content": words}],
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=11,
        logprobs=True,
    )
    whole = await client.chat.completions.create(**options, top_logprobs=2)
    assert whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content
    assert content is not None
    async with node.client() as control:
        socket = await control.generate_result(
            prompt=words + " ", max_tokens=8, temperature=0.9, top_p=0.9, seed=11, logprobs=2
        )
    assert socket.logprobs is not None and len(content) == len(socket.token_ids)
    prompt = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(words + " ").ids
    expected = reference(hf, prompt + socket.token_ids)
    for index, (entry, scored) in enumerate(zip(content, socket.logprobs, strict=True)):
        row = expected[len(prompt) + index - 1]
        assert abs(entry.logprob - float(row[scored.token_id])) < TOLERANCE, index
        assert entry.logprob == scored.logprob
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == pytest.approx(row.topk(2).values.tolist(), abs=TOLERANCE)
        assert entry.bytes == list(entry.token.encode())
    stream = await client.chat.completions.create(**options, stream=True)
    streamed = [
        scored
        async for chunk in stream
        for choice in chunk.choices
        if choice.logprobs is not None and choice.logprobs.content
        for scored in choice.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


async def test_the_socket_streams_logprobs_and_the_prompts(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any, Path]
) -> None:
    node, hf, _ = served
    async with node.client() as control:
        replies = [
            reply
            async for reply in control.generate(
                input_ids=PROMPT_IDS,
                max_tokens=5,
                ignore_eos=True,
                stream=True,
                logprobs=1,
                prompt_logprobs=0,
            )
        ]
    *tokens, result = replies
    assert result.logprobs is not None and result.prompt_logprobs is not None
    assert [lp for reply in tokens for lp in reply.logprobs] == result.logprobs
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert result.prompt_logprobs[0] is None
    assert [lp.token_id for lp in result.prompt_logprobs[1:]] == PROMPT_IDS[1:]
    expected = reference(hf, PROMPT_IDS + result.token_ids)
    for index, scored in enumerate([*result.prompt_logprobs[1:], *result.logprobs]):
        assert abs(scored.logprob - float(expected[index][scored.token_id])) < TOLERANCE
    assert all(len(lp.top_logprobs) == 1 for lp in result.logprobs)
    assert all(lp.top_logprobs == [] for lp in result.prompt_logprobs[1:])


async def test_logprobs_out_of_range_are_a_400(client: openai.AsyncOpenAI) -> None:
    name = (await client.models.list()).data[0].id
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hello"}], top_logprobs=2
        )
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        await client.completions.create(model=name, prompt="hello", logprobs=21)
