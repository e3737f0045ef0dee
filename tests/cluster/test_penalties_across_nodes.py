"""Penalties and logit bias across nodes: the prefill replica on one node samples the first token, the
decode replica on another the rest, reading the token history the request's snapshot carried — the
tokens equal the model run in one piece, greedy and seeded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.cluster.local_etcd import LocalEtcd
from replicas.model import SamplingParams, generate_in_one_piece, tiny_model
from tests.cluster.harness import cluster_nodes
from tests.node.harness import wait_idle
from tests.waiting import deadline

LAYOUT = (
    ("pre", "encode=0,prefill=1,decode=0"),
    ("dec", "encode=0,prefill=0,decode=1"),
)
PROMPT = [40, 41, 42, 40, 41, 43, 44, 40, 45, 46, 41, 47]
CASES: list[dict[str, Any]] = [
    dict(
        repetition_penalty=1.5, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={50: 3.0, 7: -100.0}
    ),
    dict(temperature=0.9, seed=5, repetition_penalty=0.7, frequency_penalty=-0.5, logit_bias={61: 2.5}),
]


async def test_penalties_give_the_tokens_of_one_piece_with_prefill_and_decode_on_two_nodes(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    model = tiny_model()
    async with cluster_nodes(tmp_path, etcd, LAYOUT) as nodes, nodes["pre"].client() as client:
        for case in CASES:
            with deadline("a generate across two nodes", 120):
                result = await client.generate_result(
                    input_ids=PROMPT, max_tokens=12, ignore_eos=True, **case
                )
            sampling = SamplingParams(
                temperature=case.get("temperature", 0.0),
                seed=case.get("seed", 0),
                ignore_eos=True,
                presence_penalty=case.get("presence_penalty", 0.0),
                frequency_penalty=case.get("frequency_penalty", 0.0),
                repetition_penalty=case["repetition_penalty"],
                logit_bias=tuple(sorted(case["logit_bias"].items())),
            )
            expected = generate_in_one_piece(model, PROMPT, sampling=sampling, max_tokens=12)
            assert result.token_ids == expected, case
            unpenalized = generate_in_one_piece(
                model,
                PROMPT,
                sampling=SamplingParams(
                    temperature=sampling.temperature, seed=sampling.seed, ignore_eos=True
                ),
                max_tokens=12,
            )
            assert expected != unpenalized, case  # the penalties changed something
            kv = [(t.source, t.destination) for t in result.transfers if t.kind == "kv"]
            assert kv == [("pre/prefill-0", "dec/decode-0")]
        for node in nodes.values():
            async with node.client() as each:
                await wait_idle(each)
