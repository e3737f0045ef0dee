"""The OpenAI-compatible API through the official `openai` client against a real node: completions and
chat, streamed and not, the usage chunk, stop strings, seeds, the API key, a disconnect mid-stream, and
outputs equal to the model run in one piece."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

from replicas.model import GREEDY, ByteTokenizer, SamplingParams, generate_in_one_piece, tiny_model
from tests.http.conftest import API_KEY
from tests.node.harness import NodeProcess
from tests.waiting import wait_until

PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32, 122, 105, 103]


def reference_text(prompt_ids: list[int], max_tokens: int, sampling: SamplingParams = GREEDY) -> str:
    model = tiny_model()
    tokens = generate_in_one_piece(model, prompt_ids, max_tokens=max_tokens, sampling=sampling)
    return ByteTokenizer(model.config.vocab_size).decode(tokens)


async def test_models_lists_the_served_model(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [model.id for model in models.data] == ["tiny"]


async def test_a_completion_equals_the_model_run_in_one_piece(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    assert reply.choices[0].text == reference_text(PROMPT_IDS, 12)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (
        len(PROMPT_IDS),
        len(PROMPT_IDS) + reply.usage.completion_tokens,
    )


async def test_a_streamed_completion_adds_up_to_the_whole_one(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="tiny", prompt="zigzag", max_tokens=10, temperature=0)
    stream = await client.completions.create(
        model="tiny",
        prompt="zigzag",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_chat_streamed_and_not_agree(client: openai.AsyncOpenAI) -> None:
    messages: list = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    whole = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(chunk.usage is None for chunk in chunks)  # no usage chunk unless asked for


async def test_a_chat_prompt_is_the_template_rendered_and_tokenized_once(client: openai.AsyncOpenAI) -> None:
    """The tiny model's template wraps each message in role tags; the rendered text is tokenized without
    the tokenizer's leading special token (the template has its own), so the chat equals a completion of
    the text's bytes as token ids."""
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    rendered = "<|user|>\nhi\n<|assistant|>\n"
    completion = await client.completions.create(
        model="tiny", prompt=list(rendered.encode()), max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(rendered.encode())  # type: ignore[union-attr]


async def test_seeded_sampling_repeats_and_matches_the_reference(client: openai.AsyncOpenAI) -> None:
    async def sample(seed: int) -> str:
        reply = await client.completions.create(
            model="tiny", prompt=PROMPT_IDS, max_tokens=10, temperature=1.5, top_p=0.9, seed=seed
        )
        return reply.choices[0].text

    first, again, other = await sample(7), await sample(7), await sample(8)
    assert first == again != other
    assert first == reference_text(PROMPT_IDS, 10, SamplingParams(temperature=1.5, top_p=0.9, seed=7))


async def test_a_stop_string_cuts_the_text_before_it(client: openai.AsyncOpenAI) -> None:
    full = (
        await client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    ).choices[0]
    at = next(i for i in range(2, len(full.text) - 1) if "\ufffd" not in full.text[i : i + 2])
    stop = full.text[at : at + 2]
    cut = full.text[: full.text.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = await client.completions.create(
                model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=[stop], stream=True
            )
            pieces = [chunk.choices[0] async for chunk in chunks if chunk.choices]
            text, reason = "".join(piece.text for piece in pieces), pieces[-1].finish_reason
        else:
            reply = await client.completions.create(
                model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=stop
            )
            text, reason = reply.choices[0].text, reply.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


async def test_min_tokens_holds_off_the_end(client: openai.AsyncOpenAI) -> None:
    reply = await client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=8, temperature=0, extra_body={"min_tokens": 8}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8


async def test_the_api_key_is_required(node: NodeProcess) -> None:
    assert node.http_url is not None
    async with httpx.AsyncClient(base_url=node.http_url, timeout=30) as bare:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = await bare.get("/v1/models", headers=headers)
            assert reply.status_code == 401
            assert reply.json()["error"]["type"] == "AuthenticationError"
        assert (await bare.get("/metrics")).status_code == 200
        assert (
            await bare.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        ).status_code == 200


async def used_blocks(http: httpx.AsyncClient) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {
        family.name: family for family in text_string_to_metric_families((await http.get("/metrics")).text)
    }
    return sum(sample.value for sample in families["zigzag:blocks_used"].samples)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_disconnects_cancels_its_request(
    http: httpx.AsyncClient, node: NodeProcess, stream: bool
) -> None:
    body = {
        "model": "tiny",
        "prompt": "x" * 64,
        "max_tokens": 4000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    before = len(node.events("request_cancelled"))
    with trio.move_on_after(1.0):  # the client goes away mid-generation
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            async for _chunk in reply.aiter_bytes():
                pass
    await wait_until(
        lambda: len(node.events("request_cancelled")) > before,
        "the request to be cancelled after the disconnect",
    )
    cancelled = node.events("request_cancelled")[-1]
    assert cancelled["reason"] == "client_disconnected"

    async def no_blocks() -> bool:
        return await used_blocks(http) == 0

    await wait_until(no_blocks, "every block back in its pool")


async def test_a_client_that_disconnects_cancels_every_choice(
    http: httpx.AsyncClient, node: NodeProcess
) -> None:
    """n=3, streamed: the client goes away once every choice has sent a chunk; all three are cancelled."""
    body = {
        "model": "tiny",
        "prompt": "y" * 40,
        "max_tokens": 4000,
        "temperature": 1.0,
        "seed": 8,
        "n": 3,
        "ignore_eos": True,
        "stream": True,
    }
    before = len(node.events("request_cancelled"))
    seen: set[int] = set()
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                seen.update(choice["index"] for choice in json.loads(line[len("data: ") :])["choices"])
            if seen == {0, 1, 2}:
                break
    await wait_until(
        lambda: len(node.events("request_cancelled")) >= before + 3,
        "the three choices to be cancelled after the disconnect",
    )
    assert {event["reason"] for event in node.events("request_cancelled")[before:]} == {"client_disconnected"}

    async def no_blocks() -> bool:
        return await used_blocks(http) == 0

    await wait_until(no_blocks, "every block back in its pool")


async def test_stop_and_min_tokens_work_on_the_socket_too(
    node: NodeProcess, client: openai.AsyncOpenAI
) -> None:
    """The control socket's `generate` takes `stop` and `min_tokens` and agrees with the HTTP API."""
    async with node.client() as control:
        full = await control.generate_result(input_ids=PROMPT_IDS, max_tokens=12)
        at = next(i for i in range(2, len(full.text) - 1) if "\ufffd" not in full.text[i : i + 2])
        stop = full.text[at : at + 2]
        cut = await control.generate_result(input_ids=PROMPT_IDS, max_tokens=12, stop=[stop])
        assert (cut.text, cut.finish_reason) == (full.text[: full.text.index(stop)], "stop")
        assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 12
        over_http = await client.completions.create(
            model="tiny", prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=stop
        )
        assert over_http.choices[0].text == cut.text
        assert over_http.usage is not None and over_http.usage.completion_tokens == len(cut.token_ids)
        held = await control.generate_result(input_ids=PROMPT_IDS, max_tokens=6, min_tokens=6)
        assert len(held.token_ids) == 6
