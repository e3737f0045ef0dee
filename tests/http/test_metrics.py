"""`GET /metrics` parses as Prometheus text and its counters agree with the requests sent; `/health`
answers 503 while no prefill and decode replica serve."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.node.harness import node_process
from tests.waiting import wait_until

PROMPTS = [[65 + i] * (5 + 3 * i) for i in range(4)]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_counters_agree_with_the_requests_sent(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    completion_tokens = 0
    for prompt in PROMPTS:
        reply = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        completion_tokens += reply.usage.completion_tokens
    refused = await http.post("/v1/completions", json={"model": "tiny", "prompt": [65] * 40_000})
    assert refused.status_code == 400
    seen = samples((await http.get("/metrics")).text)
    sent = len(PROMPTS)
    assert seen[("zigzag:requests_arrived_total", ())] == sent + 1
    assert seen[("zigzag:request_success_total", (("finished_reason", "length"),))] == sent
    assert seen[("zigzag:requests_failed_total", (("code", "bad_request"),))] == 1
    assert seen[("zigzag:prompt_tokens_total", ())] == sum(len(prompt) for prompt in PROMPTS)
    assert seen[("zigzag:generation_tokens_total", ())] == completion_tokens == 5 * sent
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert seen[(f"zigzag:{histogram}_count", ())] == sent, histogram
    assert seen[("zigzag:transfer_seconds_count", (("kind", "kv"), ("status", "success")))] == sent
    assert seen[("zigzag:transfer_rounds_count", (("kind", "kv"),))] == sent
    # One gap per token after each request's first (the first token's wait is its TTFT, not an ITL).
    assert seen[("zigzag:inter_token_latency_seconds_count", ())] == completion_tokens - sent
    assert seen[("zigzag:num_requests_running", ())] == 0
    assert seen[("zigzag:num_requests_waiting", ())] == 0
    for (name, labels), value in seen.items():
        if name == "zigzag:replica_state" and value == 1.0:
            assert dict(labels)["state"] in ("Prefill", "Decode", "Encode"), labels
    assert sum(value for (name, _), value in seen.items() if name == "zigzag:blocks_used") == 0


async def test_refused_bodies_count_as_failed_requests(http: httpx.AsyncClient) -> None:
    """A 4xx the node answers before admitting anything (the body does not decode, names another model,
    asks for what the node does not support) counts as a request that arrived and failed, by code."""
    before = samples((await http.get("/metrics")).text)
    bodies = [
        ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400),  # does not validate
        ({"model": "tiny", "prompt": "hi", "best_of": 3}, 400),  # not supported
        ({"model": "gpt-4", "prompt": "hi"}, 404),  # another model
    ]
    for body, status in bodies:
        assert (await http.post("/v1/completions", json=body)).status_code == status
    assert (await http.post("/v1/chat/completions", content=b"{not json")).status_code == 400
    after = samples((await http.get("/metrics")).text)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert grew("zigzag:requests_arrived_total") == 4
    assert grew("zigzag:requests_failed_total", (("code", "bad_request"),)) == 3
    assert grew("zigzag:requests_failed_total", (("code", "not_found"),)) == 1


async def test_every_replica_reports_its_loaded_layers(http: httpx.AsyncClient) -> None:
    """`weights_layers_loaded` is read from every replica at the scrape: those that share the node's
    resident copy too, not only the one whose load logged the progress."""
    seen = samples((await http.get("/metrics")).text)
    layers = {
        dict(labels)["replica"]: (value, dict(labels)["of"])
        for (name, labels), value in seen.items()
        if name == "zigzag:weights_layers_loaded"
    }
    replicas = {
        dict(labels)["replica"] for (name, labels), _ in seen.items() if name == "zigzag:blocks_total"
    }
    assert set(layers) == replicas and len(replicas) >= 2
    for value, total in layers.values():
        assert value == float(total) > 0


async def test_health_is_503_while_no_replica_can_serve(tmp_path: Path) -> None:
    with node_process(tmp_path, "--replicas", "decode=1") as node:
        assert node.http_url is not None
        async with httpx.AsyncClient(base_url=node.http_url, timeout=30) as http:
            await wait_until(lambda: node.events("replica_state"), "the decode replica to change state", 60)
            reply = await http.get("/health")
            assert reply.status_code == 503
            assert reply.json()["error"]["message"] == "no prefill and decode replica serve yet"


async def test_a_second_chat_turn_reports_its_cached_prefix(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """The first turn's prompt blocks stay in the prefill replica's prefix cache: the second turn, whose
    prompt starts with the first's, reports them as cached (OpenAI's usage and the Prometheus counters)."""
    before = samples((await http.get("/metrics")).text)
    messages = [
        {"role": "system", "content": "You are a terse assistant who answers in one short line."},
        {"role": "user", "content": "Name a colour."},
    ]
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And another?"},
    ]
    second = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens // 16 * 16 > 0  # the first prompt's full blocks
    after = samples((await http.get("/metrics")).text)

    def grew(name: str) -> float:
        return after[(f"zigzag:{name}", ())] - before.get((f"zigzag:{name}", ()), 0.0)

    assert grew("prefix_cache_queries_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert grew("prefix_cache_hits_total") == cached
    assert sum(value for (name, _), value in after.items() if name == "zigzag:prefix_cache_blocks") > 0
