"""Token identity through a real node, and the KV really moving.

32 concurrent requests of mixed lengths (text and token ids, greedy and seeded sampling, streamed and
not) go through the node's socket; each output must equal the model run in one piece in this process
(`engine.verify.compare`), for the tiny model and for random tiny Llama / Qwen2 checkpoints, over the
inproc and the loopback TCP transport. Each request that decoded shows one `kv` transfer carrying
exactly layers × 2 × kv_heads × head_dim × dtype size × prompt length bytes, and the node's log shows
that only prefill replicas ran prompt tokens. The `corrupt_transfer` fault hook changes the output.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from replicas.model import Model, tiny_model
from tests.node.harness import NodeProcess, default_transport, node_process, wait_idle, wait_serving
from tests.node.workload import (
    Ask,
    Outcome,
    check_outcome,
    kv_bytes_per_token,
    mixed_workload,
    send,
    send_all,
)

CONCURRENT = 32


def assert_identical(model: Model, outcomes: list[Outcome], *, transport: str) -> None:
    problems = [
        problem for outcome in outcomes for problem in check_outcome(model, outcome, transport=transport)
    ]
    assert not problems, "\n".join(problems)
    # The workload is built so that most requests decode on a decode replica (max_tokens > 1).
    moved = sum(1 for outcome in outcomes if outcome.result.transfers)
    assert moved >= len(outcomes) // 2, f"only {moved} of {len(outcomes)} requests moved their KV"


def assert_only_prefill_replicas_ran_prompts(node: NodeProcess, outcomes: list[Outcome]) -> None:
    """Every request's prompt ran once, on a prefill replica; decode replicas received the KV instead."""
    ids = {outcome.result.request_id: outcome.result.prompt_tokens for outcome in outcomes}
    started = [e for e in node.events("prefill_started") if e["request_id"] in ids]
    assert Counter(e["request_id"] for e in started) == Counter(ids.keys())
    assert {e["replica"].split("-")[0] for e in started} == {"prefill"}
    assert all(e["tokens"] == ids[e["request_id"]] for e in started)
    landed = [
        e
        for e in node.events("transfer_finished")
        if e["request_id"] in ids and e["kind"] == "kv" and e["replica"] == e["destination"]
    ]
    assert {e["replica"].split("-")[0] for e in landed} <= {"decode"}
    assert all(e["status"] == "success" and e["tokens"] == ids[e["request_id"]] for e in landed)
    decoded = {outcome.result.request_id for outcome in outcomes if len(outcome.result.token_ids) > 1}
    assert {e["request_id"] for e in landed} == decoded
    for outcome in outcomes:
        for transfer in outcome.result.transfers:
            assert (transfer.source.split("-")[0], transfer.destination.split("-")[0]) == (
                "prefill",
                "decode",
            )


async def run_identity(node: NodeProcess, model: Model, *, transport: str, text: bool) -> list[Outcome]:
    asks = mixed_workload(model, CONCURRENT, text=text)
    async with node.client() as client:
        await wait_serving(client)
        outcomes = await send_all(client, asks)
        await wait_idle(client)
    assert_identical(model, outcomes, transport=transport)
    assert_only_prefill_replicas_ran_prompts(node, outcomes)
    return outcomes


async def test_tiny_model_over_inproc(tiny_inproc_node: NodeProcess, tiny: Model) -> None:
    await run_identity(tiny_inproc_node, tiny, transport="inproc", text=True)


async def test_tiny_model_over_tcp(tiny_tcp_node: NodeProcess, tiny: Model) -> None:
    outcomes = await run_identity(tiny_tcp_node, tiny, transport="tcp", text=True)
    sources = {t.source for outcome in outcomes for t in outcome.result.transfers}
    assert sources == {"prefill-0", "prefill-1"}, "both prefill replicas should have served"


async def test_tiny_model_in_bfloat16_loads_and_moves_bfloat16_kv(tmp_path: Path) -> None:
    """`--dtype bfloat16` (the default on a GPU): the KV pools are laid out in the dtype the model runs
    in, so prefill and decode replicas serve (they failed at load with "KV cache was built for another
    model config" when the pools kept the checkpoint's dtype), and a request's KV moves at 2 bytes per
    value. One request alone, so no other sequence's batch changes its rounding: it equals the bfloat16
    model run in one piece."""
    model = tiny_model(dtype="bfloat16")
    with node_process(tmp_path, "--dtype", "bfloat16", "--replicas", "prefill=1,decode=1") as node:
        ask = Ask(input_ids=tuple(range(3, 40)), max_tokens=6, ignore_eos=True)
        async with node.client() as client:
            await wait_serving(client)
            outcome = await send(client, ask)
            await wait_idle(client)
    assert check_outcome(model, outcome, transport=default_transport()) == []
    assert [t.bytes for t in outcome.result.transfers] == [kv_bytes_per_token(model) * 37]
    assert kv_bytes_per_token(model) * 2 == kv_bytes_per_token(tiny_model())
    assert not node.events("replica_failed")


@pytest.mark.slow
async def test_qwen2_checkpoint_over_tcp(
    tmp_path: Path, hf_dirs: dict[str, Path], hf_models: dict[str, Model]
) -> None:
    with node_process(
        tmp_path, "--model", str(hf_dirs["qwen2"]), "--replicas", "prefill=1,decode=2", "--transport", "tcp"
    ) as node:
        await run_identity(node, hf_models["qwen2"], transport="tcp", text=True)


@pytest.mark.slow
async def test_llama_checkpoint_over_inproc_and_a_corrupted_transfer(
    tmp_path: Path, hf_dirs: dict[str, Path], hf_models: dict[str, Model]
) -> None:
    """The fault hook corrupts the node's first KV transfer only (`nth=0`, two decode replicas): that
    request's output changes, the 32 after it are identical (one node for both: a start costs seconds)."""
    model = hf_models["llama"]
    with node_process(
        tmp_path,
        "--model",
        str(hf_dirs["llama"]),
        "--replicas",
        "prefill=1,decode=2",
        "--transport",
        "inproc",
        "--fault",
        "corrupt_transfer:transfer=kv,nth=0",
    ) as node:
        corrupted = Ask(input_ids=tuple(range(3, 40)), max_tokens=8, ignore_eos=True)
        async with node.client() as client:
            await wait_serving(client)
            outcome = await send(client, corrupted)
        problems = check_outcome(model, outcome, transport="inproc")
        assert len(problems) == 1 and "differ from the model run in one piece" in problems[0], problems
        assert outcome.result.transfers[0].bytes == kv_bytes_per_token(model) * 37
        faults = node.events("fault_injected")
        assert [e["fault"] for e in faults] == ["corrupt_transfer"]
        assert f"of request {outcome.result.request_id} altered" in faults[0]["detail"]
        await run_identity(node, model, transport="inproc", text=True)
        # nth=0 is the node's first KV transfer, not each decode replica's.
        assert len(node.events("fault_injected")) == 1
