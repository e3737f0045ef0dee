"""The options and limits a vLLM user reaches for, through a real node and the official `openai` client:
`--host`/`--port`, `--served-model-name`, `--max-model-len`, `--seed`, `--chat-template`; prompt +
`max_tokens` over the context is a 400 naming both numbers (`bad_request` on the socket), and no
response runs past the context."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import structlog

from engine.client import ControlError
from engine.config import parse_node_config
from engine.config.credentials import node_credentials
from tests.node.harness import NodeProcess, node_process, wait_serving

CONTEXT = 64
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>> "


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, port: int) -> Iterator[NodeProcess]:
    directory: Path = tmp_path_factory.mktemp("options")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    options = ("--host", "127.0.0.1", "--port", str(port), "--served-model-name", "zz-tiny,alias")
    options += ("--max-model-len", str(CONTEXT), "--seed", "5", "--chat-template", str(template))
    with node_process(directory, *options, "--replicas", "prefill=1,decode=1") as served:
        yield served


@pytest.fixture
async def client(node: NodeProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with node.client() as control:
        await wait_serving(control)
    async with openai.AsyncOpenAI(
        base_url=f"{node.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as api:
        yield api


async def test_the_api_listens_on_host_and_port(node: NodeProcess, port: int) -> None:
    assert node.http_url == f"http://127.0.0.1:{port}"


async def test_models_lists_the_served_names_with_the_capped_context(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [model.id for model in models.data] == ["zz-tiny", "alias"]
    assert {model.model_dump()["max_model_len"] for model in models.data} == {CONTEXT}
    reply = await client.completions.create(model="alias", prompt="hi", max_tokens=2, temperature=0)
    assert reply.model == "zz-tiny"
    with pytest.raises(openai.NotFoundError) as refused:
        await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert "'zz-tiny' or 'alias'" in refused.value.message


async def test_prompt_and_max_tokens_over_the_context_is_a_400_naming_both(
    client: openai.AsyncOpenAI,
) -> None:
    prompt = [65] * 40
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="zz-tiny", prompt=prompt, max_tokens=25)
    assert refused.value.status_code == 400
    message = refused.value.message
    assert "the context is 64 tokens" in message and "a prompt of 40 tokens + max_tokens 25" in message
    assert "at most 24" in message
    # What fits is served, up to the last token of the context and not one past it.
    reply = await client.completions.create(
        model="zz-tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.total_tokens == CONTEXT
    assert reply.choices[0].finish_reason == "length"


async def test_a_chat_without_max_tokens_stops_at_the_context(client: openai.AsyncOpenAI) -> None:
    """vLLM's default: what the context leaves after the prompt."""
    reply = await client.chat.completions.create(
        model="zz-tiny",
        messages=[{"role": "user", "content": "count"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.total_tokens == CONTEXT
    assert reply.choices[0].finish_reason == "length"


async def test_chat_renders_with_the_chat_template_file(client: openai.AsyncOpenAI) -> None:
    """The byte-level tiny model: one prompt token per byte of the rendered prompt."""
    rendered = "[system] be brief\n[user] hello\n>> "
    reply = await client.chat.completions.create(
        model="zz-tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        max_tokens=1,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(rendered.encode())


async def test_the_socket_refuses_the_same_with_bad_request(node: NodeProcess) -> None:
    async with node.client() as control:
        with pytest.raises(ControlError) as refused:
            await control.generate_result(input_ids=[65] * 60, max_tokens=8)
        assert refused.value.code == "bad_request"
        assert "a prompt of 60 tokens + max_tokens 8" in refused.value.message
        # `max_tokens: null`: what the context leaves.
        result = await control.generate_result(input_ids=[65] * 60, max_tokens=None, ignore_eos=True)
        assert len(result.token_ids) == CONTEXT - 60


async def test_seed_makes_unseeded_sampling_repeat_on_a_restarted_node(
    node: NodeProcess, tmp_path: Path
) -> None:
    """Requests without a seed of their own, sampled, in the same order: the same outputs from a node
    started again with the same `--seed`; another seed (the module's node: `--seed 5`) gives others."""

    async def run(served: NodeProcess) -> list[list[int]]:
        async with served.client() as control:
            await wait_serving(control)
            return [
                (await control.generate_result(prompt=f"seed {i}", max_tokens=8, temperature=1.0)).token_ids
                for i in range(3)
            ]

    runs = []
    for _ in range(2):
        with node_process(tmp_path, "--seed", "11", "--replicas", "prefill=1,decode=1") as served:
            runs.append(await run(served))
    assert runs[0] == runs[1]
    assert await run(node) != runs[0]


def test_an_http_api_others_can_reach_without_a_key_warns_once() -> None:
    cases = {
        ("--http", "0.0.0.0:8000"): 1,
        ("--host", "10.1.2.3", "--port", "8000"): 1,
        ("--http", "0.0.0.0:8000", "--api-key", "k"): 0,
        ("--http", "127.0.0.1:8000"): 0,
        ("--http", "off"): 0,
    }
    for options, warnings in cases.items():
        with structlog.testing.capture_logs() as logs:
            node_credentials(parse_node_config(list(options)))
        warned = [entry for entry in logs if entry["event"] == "http.unauthenticated"]
        assert len(warned) == warnings, (options, logs)
        assert all("give --api-key" in entry["risk"] for entry in warned)
