"""Failures in a cluster: a node killed (-9) while its replicas work, the leader killed, a node whose
lease keepalives are blocked, etcd unreachable at start and lost later, a node that serves another
block size. Affected requests end with clear errors within the lease TTL and a few seconds; the others
give the model's tokens; no block stays taken on the survivors.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

from engine.client import ControlClient, ControlError
from engine.cluster.local_etcd import LocalEtcd
from messages.control_replies import GenerateResult, ReplicaStatus, StatusResult, TokenReply
from replicas.model import tiny_model
from tests.cluster.harness import LEASE_TTL, cluster_nodes, cluster_options, cluster_transport
from tests.node.harness import REPO_ROOT, launch_node, wait_idle, wait_status
from tests.node.workload import (
    Ask,
    Outcome,
    assert_correct,
    check_outcome,
    distinct_asks,
    mixed_workload,
    send,
)
from tests.waiting import deadline

ENDS_WITHIN = LEASE_TTL + 10.0  # the TTL, a watch round trip, and a loaded machine
SLOW_DECODE = "decode_steps_per_s=25"
DECODED_TOKENS = 3


async def _stream_until_killed(
    client: ControlClient, asks: list[Ask], kill: Callable[[], None], when_streaming: int
) -> tuple[list[GenerateResult], list[ControlError], float]:
    """Send `asks`; once `when_streaming` of them streamed tokens from their decode replica (the first
    comes from the prefill replica: three tokens are two decode steps), call `kill()`. Returns the
    outcomes, the errors, and the seconds from the kill until the last request ended."""
    outcomes: list[GenerateResult] = []
    errors: list[ControlError] = []
    streaming = trio.Event()
    started: set[int] = set()
    killed_at = 0.0

    async def one(index: int) -> None:
        try:
            ask = asks[index]
            stream = client.generate(
                input_ids=ask.input_ids, max_tokens=ask.max_tokens, ignore_eos=True, stream=True
            )
            tokens = 0
            async for reply in stream:
                if isinstance(reply, TokenReply):
                    tokens += len(reply.token_ids)
                    if tokens >= DECODED_TOKENS:
                        started.add(index)
                    if len(started) >= when_streaming:
                        streaming.set()
                elif isinstance(reply, GenerateResult):
                    outcomes.append(reply)
        except ControlError as exc:
            errors.append(exc)

    with deadline("every request of the workload ended", 120):
        async with trio.open_nursery() as nursery:
            for index in range(len(asks)):
                nursery.start_soon(one, index)
            await streaming.wait()
            killed_at = time.monotonic()
            kill()
    return outcomes, errors, time.monotonic() - killed_at


async def test_a_decode_node_killed_while_tokens_stream(tmp_path: Path, etcd: LocalEtcd) -> None:
    model = tiny_model()
    layout = (
        ("front", "encode=0,prefill=1,decode=0"),
        ("dec-a", "encode=0,prefill=0,decode=1"),
        ("dec-b", "encode=0,prefill=0,decode=1"),
    )
    asks = [Ask(input_ids=tuple(range(3, 13 + i)), max_tokens=120, ignore_eos=True) for i in range(8)]
    slow = ("--emulated-speed", SLOW_DECODE)
    async with cluster_nodes(tmp_path, etcd, layout, *slow) as nodes, nodes["front"].client() as client:
        results, errors, _ = await _stream_until_killed(client, asks, nodes["dec-a"].kill, 8)
        assert errors and results, f"errors {errors}, results {results}"
        assert {e.code for e in errors} == {"replica_failed"}, errors
        assert all("node dec-a left the cluster" in e.message for e in errors), errors
        for result in results:
            ask = next(a for a in asks if len(a.input_ids or ()) == result.prompt_tokens)
            assert not check_outcome(model, Outcome(ask, result), transport=cluster_transport())
            assert {t.destination for t in result.transfers} == {"dec-b/decode-0"}
        # no block left taken on the survivors, and the killed node gone from the view once its lease ended
        await wait_idle(client, nodes={"front", "dec-b"})
        again = await send(client, Ask(input_ids=tuple(range(3, 40)), max_tokens=5, ignore_eos=True))
        assert not check_outcome(model, again, transport=cluster_transport())


async def test_a_prefill_node_killed_mid_transfer(tmp_path: Path, etcd: LocalEtcd) -> None:
    """`stalled`'s KV transfers stall before their first chunk (the `stall_sender` hook), so it is
    killed while they are under way: those requests end with an error, the others give the model's
    tokens, and the decode replica's reservations for the killed node's transfers return to its pool."""
    model = tiny_model()
    layout = (
        ("front", "encode=0,prefill=0,decode=1"),
        ("stalled", "encode=0,prefill=1,decode=0"),
        ("steady", "encode=0,prefill=1,decode=0"),
    )
    stall = ("--fault", "stall_sender:replica=stalled/prefill-0,seconds=60")
    asks = [Ask(input_ids=tuple(range(3, 23 + i)), max_tokens=4, ignore_eos=True) for i in range(6)]
    results: list[GenerateResult] = []
    errors: list[ControlError] = []
    async with cluster_nodes(tmp_path, etcd, layout, *stall) as nodes, nodes["front"].client() as client:

        async def one(ask: Ask) -> None:
            try:
                results.append((await send(client, ask)).result)
            except ControlError as exc:
                errors.append(exc)

        with deadline("every request ended after the stalled node was killed", 60):
            async with trio.open_nursery() as nursery:
                for ask in asks:
                    nursery.start_soon(one, ask)
                await wait_status(
                    client,
                    lambda s: (
                        _replica(s, "stalled/prefill-0").migration_queue == 0
                        and _replica(s, "front/decode-0").used_blocks > 0
                        and len(results) > 0
                    ),
                    "a transfer from stalled under way and a request served by steady",
                )
                nodes["stalled"].kill()
        assert errors and results, f"errors {errors}, results {results}"
        assert {e.code for e in errors} <= {"transfer_failed", "replica_failed"}, errors
        for result in results:
            ask = next(a for a in asks if len(a.input_ids or ()) == result.prompt_tokens)
            assert not check_outcome(model, Outcome(ask, result), transport=cluster_transport())
            assert {t.source for t in result.transfers} == {"steady/prefill-0"}
        # the reservations for stalled's transfers are back, and stalled gone once its lease ended
        await wait_idle(client, nodes={"front", "steady"})


async def test_a_new_leader_runs_the_reject_loop(tmp_path: Path, etcd: LocalEtcd) -> None:
    first = launch_node(tmp_path, *cluster_options(etcd, "first", "encode=0,prefill=1,decode=0"))
    first.await_listening()
    async with first.client() as client:
        await wait_status(
            client, lambda s: s.cluster is not None and s.cluster.leader == "first", "first leads"
        )
    pool = ("--kv-pool-blocks", "64", "--emulated-speed", SLOW_DECODE)
    layout = (("work", "encode=0,prefill=1,decode=2"),)
    try:
        # `joining=1`: first's prefill replica is in the view too until first is killed below (whether
        # work's own replicas serve before or after first's report reaches work is a race)
        async with (
            cluster_nodes(tmp_path, etcd, layout, *pool, joining=1) as nodes,
            nodes["work"].client() as client,
        ):
            first.kill()
            await wait_status(
                client,
                lambda s: (
                    s.cluster is not None and s.cluster.leader == "work" and "first" not in s.cluster.nodes
                ),
                "work leads once first is gone",
                timeout=ENDS_WITHIN,
            )
            await client.lock("work/decode-1")
            long = Ask(input_ids=tuple(range(3, 103)), max_tokens=300, ignore_eos=True)
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(send, client, long)
                await wait_status(
                    client,
                    lambda s: _replica(s, "work/decode-0").used_blocks > 32,
                    "decode-0 holding more than half its pool",
                )
                await client.unlock("work/decode-1")
                locked = await wait_status(
                    client,
                    lambda s: "controller" in _replica(s, "work/decode-0").lock_reasons,
                    "the new leader's reject loop locking the skewed decode-0",
                )
                assert _replica(locked, "work/decode-1").lock_reasons == []
                nursery.cancel_scope.cancel()
            await wait_idle(client)
    finally:
        first.kill()


async def test_a_node_whose_keepalives_are_blocked_rejoins_and_places_kv_again(
    tmp_path: Path, etcd: LocalEtcd
) -> None:
    """`stalls` sends no keepalive for 3 s (its lease of 2 s expires), then rejoins under a new lease.
    It only prefills and `steady` only decodes, so every request needs a ReserveKV from `stalls` to
    `steady` under the new lease: taken, because the record `stalls` re-wrote names that lease (it
    named the expired one, and every reservation was refused `stale_lease`)."""
    model = tiny_model()
    layout = (
        ("steady", "encode=0,prefill=0,decode=1"),
        ("stalls", "encode=0,prefill=1,decode=0"),
    )
    block = ("--fault", "block_keepalive:after_s=2,seconds=3")
    async with cluster_nodes(tmp_path, etcd, layout[:1]) as steady:
        stalls = launch_node(tmp_path, *cluster_options(etcd, "stalls", layout[1][1], *block))
        try:
            stalls.await_listening()
            async with stalls.client() as client:
                joined = await wait_status(client, lambda s: s.cluster is not None, "joined")
                assert joined.cluster is not None
                lease = joined.cluster.lease
                await wait_status(
                    client,
                    lambda s: s.cluster is not None and s.cluster.state == "ok" and s.cluster.lease != lease,
                    "a new lease after the old one expired",
                    timeout=30,
                )
                await wait_status(
                    client,
                    lambda s: {r.name for r in s.replicas} == {"steady/decode-0", "stalls/prefill-0"},
                    "stalls seeing steady's replicas",
                )
                async with steady["steady"].client() as other:
                    await wait_status(
                        other,
                        lambda s: (
                            s.cluster is not None and "stalls" in s.cluster.nodes and len(s.replicas) == 2
                        ),
                        "stalls back, with its replica",
                        timeout=30,
                    )
                    outcomes = [await send(client, ask) for ask in distinct_asks(3, max_tokens=4)]
                    assert_correct(model, outcomes, transport=cluster_transport())
                    for outcome in outcomes:
                        assert [(t.source, t.destination) for t in outcome.result.transfers] == [
                            ("stalls/prefill-0", "steady/decode-0")
                        ]
                    await wait_idle(other)
        finally:
            stalls.kill()


def test_etcd_unreachable_at_start_is_one_line_naming_the_url() -> None:
    url = "http://127.0.0.1:9"  # the discard port: nothing listens there
    completed = subprocess.run(
        [sys.executable, "-m", "engine.node", "--listen", "127.0.0.1:0", "--http", "off", "--cluster", url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 2
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"engine.node: cannot join the cluster: etcd at {url} is unreachable"), last


async def test_a_node_with_another_block_size_is_refused_at_join(tmp_path: Path, etcd: LocalEtcd) -> None:
    command = [
        sys.executable,
        "-m",
        "engine.node",
        "--listen",
        "127.0.0.1:0",
        "--http",
        "off",
        *cluster_options(etcd, "two", "encode=0,prefill=1,decode=1", "--kv-block-size", "32"),
    ]
    async with cluster_nodes(tmp_path, etcd, (("one", "encode=0,prefill=1,decode=1"),)):
        completed = await trio.to_thread.run_sync(
            lambda: subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        )
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1] == (
        "engine.node: node two cannot join cluster /zigzag/default/: kv_block_size 32 (the cluster serves 16)"
    )


async def test_etcd_lost_later_leaves_nodes_serving_and_degraded(tmp_path: Path, etcd: LocalEtcd) -> None:
    model = tiny_model()
    layout = (("solo", "encode=0,prefill=1,decode=1"), ("peer", "encode=0,prefill=1,decode=1"))
    async with cluster_nodes(tmp_path, etcd, layout) as nodes, nodes["solo"].client() as client:
        etcd.pause()
        try:
            await wait_status(client, _degraded, "solo degraded", timeout=ENDS_WITHIN)
            outcome = await send(client, mixed_workload(model, 1, text=False)[0])
            assert (
                not check_outcome(model, outcome, transport=outcome.result.transfers[0].transport)
                if outcome.result.transfers
                else True
            )
            assert all(t.destination.startswith("solo/") for t in outcome.result.transfers)
        finally:
            etcd.resume()
        await wait_status(
            client, lambda s: s.cluster is not None and s.cluster.state == "ok", "solo ok again", timeout=30
        )
        assert nodes["solo"].process.poll() is None and nodes["peer"].process.poll() is None


def _degraded(status: StatusResult) -> bool:
    return status.cluster is not None and status.cluster.state == "degraded"


def _replica(status: StatusResult, name: str) -> ReplicaStatus:
    return next(r for r in status.replicas if r.name == name)
