"""vLLM's sampling fields through a real node serving an HF checkpoint, with the `openai` client: penalties
and `logit_bias` (greedy: transformers' own `generate` for the repetition penalty, a reference loop over
transformers' logits for the others; seeded sampling too), `n` choices with a seed (distinct,
reproducible, choice i the n=1 answer under seed + i), and a list of prompts — each streamed and not.
The node runs a prefill and a decode replica: the first token is sampled on one, the rest on the other;
its prefill runs in chunks of 8 tokens.

The HTTP replies carry no token ids: a choice's tokens are pinned by their log-probabilities (`logprobs`),
which equal those of the control socket's reply, whose ids are compared with the reference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from replicas.model import SamplingParams, sample_tokens
from tests.http.test_metrics import samples
from tests.model.helpers import build_hf_model, vllm_apply_penalties
from tests.node.harness import NodeProcess, node_process, wait_serving
from tests.waiting import wait_until

PROMPT = [5, 6, 7, 8, 5, 9, 3, 4, 10, 11, 3, 200, 17, 301]
OTHER = [12, 13, 14, 15, 16, 12, 13]
TOLERANCE = 1e-4
TOKENS = 10
CHUNK = 8
VLLM_ONLY = ("repetition_penalty",)
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, Any]]:
    root: Path = tmp_path_factory.mktemp("sampling")
    checkpoint = root / "llama"
    hf = build_hf_model("llama", checkpoint, seed=5)
    template = root / "chat.jinja"
    template.write_text(TEMPLATE)
    options = (
        "--model",
        str(checkpoint),
        "--chat-template",
        str(template),
        "--replicas",
        "prefill=1,decode=1",
        "--prefill-chunk-tokens",
        str(CHUNK),  # PROMPT runs in two chunks: only the last one's token is kept
    )
    with node_process(root, *options) as node:
        yield node, hf


@pytest.fixture
async def client(served: tuple[NodeProcess, Any]) -> AsyncIterator[openai.AsyncOpenAI]:
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


def last_logits(hf: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0, -1].float()


def reference(
    hf: Any, prompt: list[int], fields: dict[str, Any], steps: int
) -> tuple[list[int], list[float]]:
    """The tokens and their raw log-probabilities: each step transformers' logits, the bias added, vLLM's
    penalties applied (`vllm_apply_penalties`), then greedy or the node's (seed, index) draw."""
    plain = SamplingParams(temperature=fields.get("temperature", 0.0), seed=fields.get("seed", 0))
    generated: list[int] = []
    scores: list[float] = []
    for _ in range(steps):
        logits = last_logits(hf, prompt + generated)
        raw = torch.log_softmax(logits, dim=-1)
        for token, value in fields.get("logit_bias", {}).items():
            logits[int(token)] += value
        adjusted = vllm_apply_penalties(
            logits[None],
            [prompt],
            [generated],
            [fields.get("presence_penalty", 0.0)],
            [fields.get("frequency_penalty", 0.0)],
            [fields.get("repetition_penalty", 1.0)],
        )
        token = sample_tokens(adjusted, [plain], [len(prompt) + len(generated)])[0]
        generated.append(token)
        scores.append(float(raw[token]))
    return generated, scores


async def completion_scores(
    client: openai.AsyncOpenAI, prompt: Any, *, stream: bool = True, **fields: Any
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Each choice's token log-probabilities, by index: from the whole reply, and from the stream (the
    whole reply's again when `stream` is false)."""
    name = (await client.models.list()).data[0].id
    extra = {key: fields.pop(key) for key in VLLM_ONLY if key in fields}  # not in OpenAI's API
    options = dict(model=name, prompt=prompt, max_tokens=TOKENS, logprobs=0, extra_body=extra, **fields)
    whole = await client.completions.create(**options)
    by_index = {}
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        by_index[choice.index] = choice.logprobs.token_logprobs
    assert sorted(by_index) == list(range(len(whole.choices)))
    if not stream:
        return by_index, by_index
    streamed: dict[int, list[float]] = {}
    finished: set[int] = set()
    stream = await client.completions.create(**options, stream=True, stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.token_logprobs:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == set(by_index)
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens == sum(map(len, by_index.values()))
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    return by_index, streamed


def close(got: list[float], expected: list[float]) -> bool:
    return len(got) == len(expected) and all(
        abs(a - b) < TOLERANCE for a, b in zip(got, expected, strict=True)
    )


def same(got: dict[int, list[float]], expected: dict[int, list[float]]) -> bool:
    """The same choices: the same tokens, whose log-probabilities differ only by rounding (a decode
    batch of other sizes sums in another order)."""
    return sorted(got) == sorted(expected) and all(close(got[i], expected[i]) for i in got)


async def test_greedy_repetition_penalty_equals_transformers_generate(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any]
) -> None:
    node, hf = served
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=TOKENS,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=0,
        )
    expected = out[0, len(PROMPT) :].tolist()
    async with node.client() as control:
        result = await control.generate_result(
            input_ids=PROMPT, max_tokens=TOKENS, repetition_penalty=1.8, logprobs=0
        )
        plain = await control.generate_result(input_ids=PROMPT, max_tokens=TOKENS)
    assert result.token_ids == expected
    assert plain.token_ids != expected  # the penalty changed the answer
    assert result.logprobs is not None
    socket_scores = [entry.logprob for entry in result.logprobs]
    whole, streamed = await completion_scores(client, PROMPT, temperature=0, repetition_penalty=1.8)
    assert same(whole, {0: socket_scores}) and same(streamed, whole)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {"42": 4.0}},
        {"temperature": 0, "frequency_penalty": -1.0, "repetition_penalty": 0.9, "logit_bias": {"7": -100.0}},
        {
            "temperature": 0.8,
            "seed": 9,
            "presence_penalty": -0.5,
            "frequency_penalty": 2.0,
            "repetition_penalty": 1.2,
        },
    ],
)
async def test_presence_frequency_and_bias_equal_a_reference_over_transformers_logits(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any], fields: dict[str, Any]
) -> None:
    node, hf = served
    expected, expected_scores = reference(hf, PROMPT, fields, TOKENS)
    unpenalized, _ = reference(
        hf, PROMPT, {k: fields[k] for k in ("temperature", "seed") if k in fields}, TOKENS
    )
    assert expected != unpenalized  # the fields change the answer
    bias = {int(token): value for token, value in fields.get("logit_bias", {}).items()}
    socket_fields = {k: v for k, v in fields.items() if k != "logit_bias"}
    async with node.client() as control:
        result = await control.generate_result(
            input_ids=PROMPT, max_tokens=TOKENS, logprobs=0, logit_bias=bias, **socket_fields
        )
    assert result.token_ids == expected
    whole, streamed = await completion_scores(client, PROMPT, **fields)
    assert close(whole[0], expected_scores) and same(streamed, whole)


async def test_n_choices_with_a_seed_differ_repeat_and_are_n1_under_seed_plus_i(
    client: openai.AsyncOpenAI,
) -> None:
    fields = dict(temperature=1.0, seed=11, presence_penalty=0.3)
    whole, streamed = await completion_scores(client, PROMPT, n=3, **fields)
    assert same(streamed, whole) and sorted(whole) == [0, 1, 2]
    assert not any(close(whole[i], whole[j]) for i, j in ((0, 1), (0, 2), (1, 2)))  # three distinct choices
    again, _ = await completion_scores(client, PROMPT, stream=False, n=3, **fields)
    assert same(again, whole)
    for i in range(3):
        single, _ = await completion_scores(client, PROMPT, stream=False, **{**fields, "seed": 11 + i})
        assert same(single, {0: whole[i]})
    name = (await client.models.list()).data[0].id
    chat = dict(model=name, messages=[{"role": "user", "content": "the cat sat"}], max_tokens=4, n=2, seed=3)
    reply = await client.chat.completions.create(**chat)
    stream = await client.chat.completions.create(**chat, stream=True)
    texts: dict[int, str] = {}
    roles: set[int] = set()
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role == "assistant":
                roles.add(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert roles == {0, 1}
    assert texts == {choice.index: choice.message.content for choice in reply.choices}
    assert reply.usage is not None and reply.usage.completion_tokens == 8


async def test_the_choices_after_the_first_borrow_its_prompts_kv(
    client: openai.AsyncOpenAI, served: tuple[NodeProcess, Any]
) -> None:
    """n=4 on a fresh 40-token prompt: choice 0 computes it; choices 1-3 find its two full KV blocks (32
    tokens) in the prefix cache and compute only the last 8. With `echo` and `logprobs` too."""
    node = served[0]
    assert node.http_url is not None
    async with httpx.AsyncClient(base_url=node.http_url, timeout=30) as http:
        before = samples((await http.get("/metrics")).text)
        name = (await client.models.list()).data[0].id
        prompt = list(range(100, 140))
        reply = await client.completions.create(model=name, prompt=prompt, max_tokens=3, n=4, seed=1)
        after = samples((await http.get("/metrics")).text)
        assert len(reply.choices) == 4 and reply.usage is not None and reply.usage.prompt_tokens == 40
        hits = ("zigzag:prefix_cache_hits_total", ())
        assert after[hits] - before.get(hits, 0.0) == 3 * 32
        # With echo and logprobs, choice 0 scores the prompt (no cache lookup: it computes every row) and
        # the others show its scores, borrowing its KV.
        echo = dict(
            model=name, prompt=list(range(150, 190)), max_tokens=3, n=3, seed=2, echo=True, logprobs=1
        )
        whole = await client.completions.create(**echo)
        stream = await client.completions.create(**echo, stream=True)
        streamed: dict[int, list[float | None]] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.token_logprobs:
                    streamed.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
        last = samples((await http.get("/metrics")).text)
    assert last[hits] - after[hits] == 2 * 2 * 32
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        scores = choice.logprobs.token_logprobs
        assert len(scores) == 43 and scores[0] is None
        assert scores[:40] == whole.choices[0].logprobs.token_logprobs[:40]  # type: ignore[union-attr]
        assert streamed[choice.index][:40] == scores[:40]


async def test_a_list_of_prompts_answers_each_n_times_in_openais_order(client: openai.AsyncOpenAI) -> None:
    fields = dict(temperature=0.9, seed=4, frequency_penalty=0.5)
    whole, streamed = await completion_scores(client, [PROMPT, OTHER], n=2, **fields)
    assert same(streamed, whole) and sorted(whole) == [0, 1, 2, 3]
    for number, prompt in enumerate([PROMPT, OTHER]):
        for i in range(2):
            single, _ = await completion_scores(client, prompt, stream=False, **{**fields, "seed": 4 + i})
            assert same(single, {0: whole[number * 2 + i]})
    name = (await client.models.list()).data[0].id
    texts = ["hello world", "the cat sat on"]
    reply = await client.completions.create(model=name, prompt=texts, max_tokens=3, temperature=0, echo=True)
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice, text in zip(reply.choices, texts, strict=True):
        alone = await client.completions.create(
            model=name, prompt=text, max_tokens=3, temperature=0, echo=True
        )
        assert choice.text == alone.choices[0].text and choice.text.startswith(text)
    assert reply.usage is not None and reply.usage.completion_tokens == 6
