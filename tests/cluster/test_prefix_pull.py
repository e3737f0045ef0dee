"""Pulls (docs/prefix-cache.md, "Pulls"): a prompt whose prefix another node's replica caches is routed to
this node's replica, which pulls those blocks over the transfer protocol instead of computing them — the
output is the model's run in one piece, and the result names where the cached tokens came from; the same
within one node. A decode replica keeps a finished turn's prompt and answer: the next turn pulls them
from there, on its node or from another. A holder killed mid-pull: the prompt is computed here instead,
with the model's tokens, and every block goes back. The nodes then stop with exit code 0: their shutdown's leak check counts the
caches' borrowings too (the holder's for the send, the puller's for the prompt)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
import trio

from engine.cluster.local_etcd import LocalEtcd
from replicas.model import tiny_model
from tests.cluster.harness import cluster_nodes, cluster_transport
from tests.http.test_metrics import samples
from tests.node.harness import (
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_states,
    wait_status,
)
from tests.node.workload import Ask, Outcome, check_outcome, send

# `a` computes the first prompt (one token: it ends there, its blocks stay in a's cache); `b` gets the
# follow-up and, on a tie of routing costs (`always`: a pullable prefix counts as held), keeps it.
LAYOUT = (("a", "encode=0,prefill=1,decode=0"), ("b", "encode=0,prefill=1,decode=1"))


def _prompts(seed: int) -> tuple[Ask, Ask]:
    model = tiny_model()
    rng = random.Random(seed)
    vocabulary = [i for i in range(model.config.vocab_size) if i != model.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(80))
    follow_up = (*first, *(rng.choice(vocabulary) for _ in range(20)))
    return Ask(input_ids=first, max_tokens=1), Ask(input_ids=follow_up, max_tokens=4, seed=5)


# `auto` with configured speeds: 1,000 prompt tokens/s against 10 Gbit/s moves a token 600× faster than
# it computes (the tiny model's 2 KiB per token); queue-only routing keeps the prompt on b.
AUTO = (
    "--prefix-pull=auto",
    "--prefix-pull-link-gbps=10",
    "--emulated-speed=prefill_tokens_per_s=1000",
    "--prefix-route-weight=0",
)


@pytest.mark.parametrize("options", [("--prefix-pull=always",), AUTO], ids=["always", "auto"])
async def test_a_prefix_cached_on_another_node_is_pulled(
    tmp_path: Path, etcd: LocalEtcd, options: tuple[str, ...]
) -> None:
    model = tiny_model()
    ask, follow_up = _prompts(3)
    async with cluster_nodes(tmp_path, etcd, LAYOUT, *options) as nodes:
        async with nodes["a"].client() as client:
            alone = await send(client, ask)
            await wait_idle(client)
        async with nodes["b"].client() as client:
            await wait_status(
                client,
                lambda status: by_name(status)["a/prefill-0"].prefix_blocks == 5,
                "node a's report of its prefix cache reaching node b",
            )
            pulled = await send(client, follow_up)
            await wait_idle(client)
        assert nodes["b"].http_url is not None
        async with httpx.AsyncClient(base_url=nodes["b"].http_url) as http:
            metrics = samples((await http.get("/metrics")).text)
        started = {e["request_id"]: e for e in nodes["b"].events("prefill_started")}
        pulls = nodes["b"].events("transfer_finished")
        for node in ("b", "a"):  # exit code 0: no block and no borrowing of either cache left behind
            nodes[node].stop()
    assert pulled.result.cached_tokens == 80
    assert pulled.result.cached_from == "a/prefill-0"
    event = started[pulled.result.request_id]
    assert (event["replica"], event["cached_tokens"], event["cached_from"]) == (
        "b/prefill-0",
        80,
        "a/prefill-0",
    )
    (pull,) = [e for e in pulls if e["kind"] == "pull"]
    assert (pull["status"], pull["tokens"], pull["source"]) == ("success", 80, "a/prefill-0")
    assert pull["bytes"] > 0 and metrics[("zigzag:kv_pulled_bytes_total", ())] == pull["bytes"]
    for outcome in (alone, pulled):
        assert check_outcome(model, outcome, transport=cluster_transport()) == []


async def test_a_holder_killed_mid_pull_leaves_the_prompt_computed(tmp_path: Path, etcd: LocalEtcd) -> None:
    """a's sends stall (the `stall_sender` hook) so that it is killed while b pulls from it: b computes
    the prompt itself, the tokens are the model's, and no block stays taken on b."""
    model = tiny_model()
    ask, follow_up = _prompts(4)
    stall = ("--fault", "stall_sender:replica=a/prefill-0,seconds=60")
    async with cluster_nodes(tmp_path, etcd, LAYOUT, "--prefix-pull", "always", *stall) as nodes:
        async with nodes["a"].client() as client:
            await send(client, ask)
            await wait_idle(client)
        async with nodes["b"].client() as client, trio.open_nursery() as nursery:
            await wait_status(
                client,
                lambda status: by_name(status)["a/prefill-0"].prefix_blocks == 5,
                "node a's report of its prefix cache reaching node b",
            )
            outcomes: list[Outcome] = []

            async def one() -> None:
                outcomes.append(await send(client, follow_up))

            nursery.start_soon(one)
            await nodes["b"].wait_event("transfer_started", lambda e: e["kind"] == "pull")
            nodes["a"].kill()
        async with nodes["b"].client() as client:
            await wait_idle(client, nodes={"b"})
        (pull,) = [e for e in nodes["b"].events("transfer_finished") if e["kind"] == "pull"]
        nodes["b"].stop()  # exit code 0: nothing leaked
    (computed,) = outcomes
    assert pull["status"] == "failed"
    assert computed.result.cached_tokens == 0 and computed.result.cached_from is None
    assert check_outcome(model, computed, transport=cluster_transport()) == []


async def test_a_prefix_is_pulled_from_another_replica_of_the_node(tmp_path: Path) -> None:
    """The replica that computed a prompt became a decode replica, its cache kept: the next prompt with
    that prefix runs on the other prefill replica, which pulls the prefix from it (one node, its own
    transport)."""
    tiny = tiny_model()
    rng = random.Random(11)
    vocabulary = [i for i in range(tiny.config.vocab_size) if i != tiny.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(70))  # 4 full blocks and 6 tokens
    follow_up = (*first, *(rng.choice(vocabulary) for _ in range(30)))
    options = ("--replicas", "prefill=2,decode=1", "--prefix-pull", "always")
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            computed = await send(client, Ask(input_ids=first, max_tokens=3, ignore_eos=True))
            await wait_idle(client)
            await client.transition("prefill-0", "MutatingToDecode")  # the holder stops prefilling
            status = await wait_states(client, {"prefill-0": "Decode"})
            assert by_name(status)["prefill-0"].prefix_blocks == 4
            pulled = await send(client, Ask(input_ids=follow_up, max_tokens=4, seed=2, temperature=0.7))
            await wait_idle(client)
        started = {e["request_id"]: e for e in node.events("prefill_started")}
        (pull,) = [e for e in node.events("transfer_finished") if e["kind"] == "pull"]
    assert (pulled.result.cached_tokens, pulled.result.cached_from) == (64, "prefill-0")
    assert started[pulled.result.request_id]["replica"] == "prefill-1"
    assert (pull["status"], pull["source"], pull["destination"], pull["tokens"]) == (
        "success",
        "prefill-0",
        "prefill-1",
        64,
    )
    for outcome in (computed, pulled):
        assert check_outcome(tiny, outcome, transport=default_transport()) == []


async def test_the_next_turn_pulls_its_prefix_from_the_decode_replica(tmp_path: Path) -> None:
    """A finished turn's prompt *and* answer stay in its decode replica's cache: the next turn — that
    prompt, that answer and a new message — pulls them from there, past the end of the first prompt."""
    tiny = tiny_model()
    rng = random.Random(13)
    vocabulary = [i for i in range(tiny.config.vocab_size) if i != tiny.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(40))  # 2 full blocks and 8 tokens
    options = ("--replicas", "prefill=1,decode=1", "--prefix-pull", "always")
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            turn = await send(client, Ask(input_ids=first, max_tokens=30, ignore_eos=True))
            await wait_idle(client)
            # The KV written: the 40 prompt tokens and 29 of the 30 generated — 4 full blocks.
            status = await wait_status(
                client,
                lambda status: by_name(status)["decode-0"].prefix_blocks == 4,
                "the decode replica keeping the first turn's blocks",
            )
            assert by_name(status)["prefill-0"].prefix_blocks == 2
            answer = tuple(turn.result.token_ids)
            second = (*first, *answer, *(rng.choice(vocabulary) for _ in range(20)))
            next_turn = await send(client, Ask(input_ids=second, max_tokens=4, seed=3, temperature=0.7))
            await wait_idle(client)
        (pull,) = [e for e in node.events("transfer_finished") if e["kind"] == "pull"]
    assert (next_turn.result.cached_tokens, next_turn.result.cached_from) == (64, "decode-0")
    assert (pull["status"], pull["source"], pull["destination"]) == ("success", "decode-0", "prefill-0")
    for outcome in (turn, next_turn):
        assert check_outcome(tiny, outcome, transport=default_transport()) == []


async def test_the_next_turn_pulls_its_prefix_from_another_nodes_decode_replica(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    """The decode replica's cache is reported to the other nodes like any replica's: the next turn, sent
    to node b, pulls the first turn's prompt and answer from a's decode replica."""
    tiny = tiny_model()
    rng = random.Random(17)
    vocabulary = [i for i in range(tiny.config.vocab_size) if i != tiny.config.image_token_id]
    first = tuple(rng.choice(vocabulary) for _ in range(40))
    layout = (("a", "encode=0,prefill=1,decode=1"), ("b", "encode=0,prefill=1,decode=0"))
    async with cluster_nodes(tmp_path, etcd, layout, "--prefix-pull=always") as nodes:
        async with nodes["a"].client() as client:
            turn = await send(client, Ask(input_ids=first, max_tokens=30, ignore_eos=True))
            await wait_idle(client)
        async with nodes["b"].client() as client:
            await wait_status(
                client,
                lambda status: by_name(status)["a/decode-0"].prefix_blocks == 4,
                "node a's report of its decode replica's cache reaching node b",
            )
            second = (*first, *turn.result.token_ids, *(rng.choice(vocabulary) for _ in range(20)))
            next_turn = await send(client, Ask(input_ids=second, max_tokens=4, seed=3, temperature=0.7))
            await wait_idle(client)
        (pull,) = [e for e in nodes["b"].events("transfer_finished") if e["kind"] == "pull"]
        for node in ("b", "a"):  # exit code 0: no block and no borrowing of either cache left behind
            nodes[node].stop()
    assert (next_turn.result.cached_tokens, next_turn.result.cached_from) == (64, "a/decode-0")
    assert (pull["status"], pull["source"], pull["destination"]) == ("success", "a/decode-0", "b/prefill-0")
    for outcome in (turn, next_turn):
        assert check_outcome(tiny, outcome, transport=cluster_transport()) == []
