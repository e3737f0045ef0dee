"""Token identity across processes: encode, prefill and decode replicas in three node processes of one
cluster, 32 mixed requests (text, token ids, images; greedy and seeded; streamed or not) sent to one
node, each output equal to the model run in one piece, every transfer over tcp (or ucx), none inproc;
a request's log-probabilities (its prompt's from the prefill node, its tokens' from both) reach the
node it was sent to; a structured output (a JSON schema) decoded on another node than its prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import trio

from engine.client import ControlClient
from engine.cluster.local_etcd import LocalEtcd
from messages.control_replies import GenerateResult
from messages.grammar import JsonGrammar
from replicas.model import (
    Executor,
    KVCache,
    Model,
    PrefillSequence,
    SamplingParams,
    generate_in_one_piece,
    tiny_model,
)
from tests.cluster.harness import cluster_nodes, cluster_transport
from tests.epd.images import image_input, image_with_rows, reference
from tests.node.harness import wait_idle
from tests.node.workload import check_outcome, mixed_workload, send
from tests.waiting import deadline

LAYOUT = (
    ("enc", "encode=1,prefill=0,decode=0"),
    ("pre", "encode=0,prefill=1,decode=0"),
    ("dec", "encode=0,prefill=0,decode=1"),
)
IMAGE_PROMPTS = ("<image> one", "two <image> and <image>", "<image>", "three <image> here")


async def test_three_processes_give_the_tokens_of_the_model_in_one_piece(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    model = tiny_model()
    transport = cluster_transport()
    asks = mixed_workload(model, 28, text=True)
    images = [
        [image_with_rows(rows, seed=index * 7 + n) for n, rows in enumerate((12, 40)[: p.count("<image>")])]
        for index, p in enumerate(IMAGE_PROMPTS)
    ]
    async with cluster_nodes(tmp_path, etcd, LAYOUT) as nodes, nodes["enc"].client() as client:
        status = await client.status()
        pids = {r.node: r.pid for r in status.replicas}
        assert set(pids) == {"enc", "pre", "dec"} and len(set(pids.values())) == 3, status.replicas
        assert status.cluster is not None and status.cluster.nodes == ["dec", "enc", "pre"]
        outcomes: dict[int, object] = {}
        image_results: dict[int, GenerateResult] = {}

        async def text(index: int) -> None:
            outcomes[index] = await send(client, asks[index])

        async def pictured(index: int) -> None:
            image_results[index] = await _with_images(client, IMAGE_PROMPTS[index], images[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(asks)):
                nursery.start_soon(text, index)
            for index in range(len(IMAGE_PROMPTS)):
                nursery.start_soon(pictured, index)
        problems = []
        for outcome in outcomes.values():
            problems += check_outcome(model, outcome, transport=transport)  # type: ignore[arg-type]
        for index, result in image_results.items():
            expected = reference(model, IMAGE_PROMPTS[index], images[index], 6)
            if result.token_ids != expected:
                problems.append(f"{IMAGE_PROMPTS[index]!r}: {result.token_ids} != {expected}")
            kinds = sorted(t.kind for t in result.transfers)
            if kinds != ["embedding", "kv"]:
                problems.append(f"{IMAGE_PROMPTS[index]!r}: transfers {kinds}")
        assert not problems, "\n".join(problems)
        every = [t for o in outcomes.values() for t in o.result.transfers] + [  # type: ignore[attr-defined]
            t for r in image_results.values() for t in r.transfers
        ]
        assert {t.transport for t in every} == {transport}
        assert {(t.source, t.destination) for t in every if t.kind == "kv"} == {
            ("pre/prefill-0", "dec/decode-0")
        }
        assert {(t.source, t.destination) for t in every if t.kind == "embedding"} == {
            ("enc/encode-0", "pre/prefill-0")
        }
        await _logprobs_cross_nodes(client, model)
        await _grammar_cross_nodes(client, model)
        for node in nodes.values():
            async with node.client() as each:
                await wait_idle(each)  # every block back in its pool, on every node


async def _logprobs_cross_nodes(client: ControlClient, model: Model) -> None:
    prompt = list(range(40, 60))
    with deadline("the reply to a generate with logprobs", 120):
        result = await client.generate_result(
            input_ids=prompt, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=0
        )
    assert result.logprobs is not None and result.prompt_logprobs is not None
    assert [entry.token_id for entry in result.logprobs] == result.token_ids
    assert all(len(entry.top_logprobs) == 2 for entry in result.logprobs)
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    tokens = prompt + result.token_ids
    cache = KVCache.create(model.config, 4)
    table = cache.pool.allocate(cache.blocks_for(len(tokens)), "reference")
    whole = Executor(model, cache).prefill(
        [PrefillSequence(block_table=table, token_ids=tokens, prompt_logprobs=0)]
    )
    assert whole.prompt_logprobs is not None and whole.prompt_logprobs[0] is not None
    expected = [entry.logprob for entry in whole.prompt_logprobs[0]]
    got = [entry.logprob for entry in [*result.prompt_logprobs[1:], *result.logprobs] if entry is not None]
    assert np.allclose(got, expected, atol=1e-4), (got, expected)


async def _grammar_cross_nodes(client: ControlClient, model: Model) -> None:
    """A structured output prefilled on one node and decoded on another, each rebuilding the grammar's
    matcher from the spec and the tokens so far: the tokens of the model in one piece, a JSON answer."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    grammar = JsonGrammar(schema=json.dumps(schema))
    for temperature, seed in ((0.0, 0), (1.0, 11)):
        with deadline("the reply to a generate with a grammar", 120):
            result = await client.generate_result(
                input_ids=list(range(70, 90)),
                max_tokens=40,
                temperature=temperature,
                seed=seed,
                grammar=grammar,
            )
        sampling = SamplingParams(temperature=temperature, seed=seed, grammar=grammar)
        assert result.token_ids == generate_in_one_piece(
            model, list(range(70, 90)), max_tokens=40, sampling=sampling
        )
        assert result.finish_reason == "stop" and set(json.loads(result.text)) == {"ok", "n"}
        assert [(t.source, t.destination) for t in result.transfers if t.kind == "kv"] == [
            ("pre/prefill-0", "dec/decode-0")
        ]


async def _with_images(client: ControlClient, prompt: str, images: list[np.ndarray]) -> GenerateResult:
    with deadline(f"the reply to {prompt!r}", 120):
        return await client.generate_result(
            prompt=prompt, images=[image_input(image) for image in images], max_tokens=6, ignore_eos=True
        )
