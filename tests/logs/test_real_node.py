"""`python -m engine.logs` on the logs of real nodes run here.

Two nodes run as subprocesses (`python -m engine.node --log-file ...`) on unix sockets, driven through
`engine.client.ControlClient`:

- node A (encode=1, prefill=1, decode=2; 4-token embedding blocks, one block per grant, so a 64×64 image —
  16 embedding rows — needs 4 REQUEST_MORE_CACHE rounds): text and image generates, decode-1 locked and
  unlocked, shut down (ShuttingDecode → ShuttingNull) and revived (AusDecode → Decode), a generate the node
  refuses (a token id outside the vocabulary), a line that is not JSON, then `metrics` and `shutdown`;
- node B (prefill=1, decode=1, a prefix cache of 2 blocks): two text generates, a 40-token prompt twice (the
  second borrows its two full 16-token blocks), another 40-token prompt (its blocks evict those two), then
  `shutdown` once a `blocks_report` shows the evictions.

What the node must log for these to hold (docs/logging.md): `request_arrived` for every generate it
admits to parsing (the refused one included), `request_failed` with the error code it replies with,
`transfer_finished` with the rounds it reports in the result, `replica_state` for every move, and
`replica_locked` / `replica_unlocked`. Its `metrics` op is `engine.logs.metrics.metrics_result` over an
`Aggregator` fed with every event it emits, so it must equal the summary of its log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import msgspec
import pytest
import trio

from engine.client import ControlClient, ControlError
from engine.logs.__main__ import main
from engine.logs.aggregate import Aggregator
from engine.logs.metrics import metrics_result
from engine.logs.reader import read_entries
from engine.logs.summary import Summary, summarize
from engine.logs.timeline import Timeline, build_timeline
from messages.control import ImageInput, ReplicaStateName
from messages.control_replies import GenerateResult, MetricsResult
from messages.log.events import BlocksReport
from tests.waiting import deadline, wait_until

STARTUP_TIMEOUT = 60.0
STEP_TIMEOUT = 30.0
SERVING: frozenset[str] = frozenset({"Encode", "Prefill", "Decode"})
OUT_OF_VOCABULARY = 1 << 20  # the tiny model has 260 token ids


@dataclass
class NodeRun:
    """One node's run: its log, and what the test sent and was answered."""

    name: str
    log: Path
    results: list[GenerateResult] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    generates: int = 0
    driven: dict[str, list[ReplicaStateName]] = field(default_factory=dict)
    metrics: MetricsResult | None = None
    exit_code: int | None = None


def _node_command(socket: Path, log: Path, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine.node",
        "--listen",
        f"unix:{socket}",
        "--http",
        "127.0.0.1:0",
        "--log-file",
        str(log),
        "--no-log-console",
        "--model",
        "tiny",
        "--controller-report-period",
        "0.2",
        "--shutdown-drain-deadline",
        "10",
        *options,
    ]


async def _wait_for_states(client: ControlClient, wanted: dict[str, frozenset[str]]) -> None:
    """Poll `status` until every named replica is in one of its wanted states."""

    async def reached() -> bool:
        status = await client.status()
        states = {replica.name: replica.state for replica in status.replicas}
        return all(states.get(name) in allowed for name, allowed in wanted.items())

    await wait_until(reached, f"replica states {wanted}", STARTUP_TIMEOUT, interval=0.05)


async def _generate(client: ControlClient, run: NodeRun, **request: object) -> None:
    run.generates += 1
    try:
        with deadline(f"node {run.name}'s reply to generate {request.get('prompt')!r}", STEP_TIMEOUT):
            run.results.append(await client.generate_result(ignore_eos=True, **request))  # type: ignore[arg-type]
    except ControlError as exc:
        run.errors[exc.code] += 1


async def _transition(
    client: ControlClient, run: NodeRun, replica: str, to: ReplicaStateName, then: str
) -> None:
    with deadline(f"node {run.name}'s {replica} transition to {to}", STEP_TIMEOUT):
        await client.transition(replica, to)
    run.driven.setdefault(replica, []).extend([to, then])  # type: ignore[list-item]
    await _wait_for_states(client, {replica: frozenset({then})})


async def _send_bad_line(socket: Path, run: NodeRun) -> None:
    with deadline(f"node {run.name}'s reply to a bad line", STEP_TIMEOUT):
        stream = await trio.open_unix_socket(str(socket))
        async with stream:
            await stream.send_all(b"hello\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = await stream.receive_some(65536)
                assert chunk, "the node closed the connection instead of answering the bad line"
                reply += chunk
    assert msgspec.json.decode(reply)["code"] == "bad_request"
    run.errors["bad_request"] += 1


async def _drive_a(socket: Path, run: NodeRun) -> None:
    image = ImageInput(width=64, height=64, pixels=bytes(range(256)) * 48)
    async with ControlClient.connect(f"unix:{socket}") as client:
        await _wait_for_states(
            client, {name: SERVING for name in ("encode-0", "prefill-0", "decode-0", "decode-1")}
        )
        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(partial(_generate, client, run, prompt=f"text {index}", max_tokens=4))
            for index in range(2):
                nursery.start_soon(
                    partial(
                        _generate,
                        client,
                        run,
                        prompt=f"<image> picture {index}",
                        images=[image],
                        max_tokens=3,
                    )
                )
        with deadline("locking decode-1", STEP_TIMEOUT):
            await client.lock("decode-1")
        await _generate(client, run, prompt="while decode-1 is locked", max_tokens=2)
        with deadline("unlocking decode-1", STEP_TIMEOUT):
            await client.unlock("decode-1")
        await _transition(client, run, "decode-1", "ShuttingDecode", "ShuttingNull")
        await _transition(client, run, "decode-1", "AusDecode", "Decode")
        await _generate(client, run, input_ids=[OUT_OF_VOCABULARY], max_tokens=2)
        await _send_bad_line(socket, run)
        with deadline("node a's metrics and shutdown replies", STEP_TIMEOUT):
            run.metrics = await client.metrics()
            await client.shutdown()


async def _drive_b(socket: Path, run: NodeRun) -> None:
    async with ControlClient.connect(f"unix:{socket}") as client:
        await _wait_for_states(client, {"prefill-0": SERVING, "decode-0": SERVING})
        for index in range(2):
            await _generate(client, run, prompt=f"other node {index}", max_tokens=3)
        for ids in (SHARED, SHARED, OTHER):
            await _generate(client, run, input_ids=ids, max_tokens=2)
        await wait_until(
            partial(_evictions_reported, run.log), "node b's report of 2 evictions", STEP_TIMEOUT
        )
        with deadline("node b's shutdown reply", STEP_TIMEOUT):
            await client.shutdown()


SHARED = list(range(1, 41))
OTHER = list(range(101, 141))


async def _evictions_reported(log: Path) -> bool:
    entries, _ = read_entries([log])
    return any(
        isinstance(entry.event, BlocksReport) and any(r.prefix_evicted >= 2 for r in entry.event.replicas)
        for entry in entries
    )


async def _run_node(
    run: NodeRun, socket: Path, options: list[str], drive: Callable[[Path, NodeRun], Awaitable[None]]
) -> None:
    stderr = run.log.with_suffix(".stderr")
    with stderr.open("wb") as errors:
        process = await trio.lowlevel.open_process(
            _node_command(socket, run.log, *options), stdout=subprocess.PIPE, stderr=errors
        )
        try:
            # The node prints {"listening": ...} once its socket accepts (the socket file exists earlier).
            assert process.stdout is not None
            line = b""
            with deadline(f"node {run.name}'s listening line", STARTUP_TIMEOUT):
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, f"node {run.name} exited before listening: {stderr.read_text()}"
                    line += chunk
            assert b"listening" in line, line
            await drive(socket, run)
            with deadline(f"node {run.name} exiting after its shutdown", STARTUP_TIMEOUT):
                run.exit_code = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeRun, NodeRun]]:
    logs = tmp_path_factory.mktemp("real-node")
    sockets = Path(tempfile.mkdtemp(prefix="zz-logs-", dir="/tmp"))  # unix socket paths must stay short
    first, second = NodeRun("a", logs / "node-a.jsonl"), NodeRun("b", logs / "node-b.jsonl")

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _run_node,
                first,
                sockets / "a.sock",
                [
                    "--replicas",
                    "encode=1,prefill=1,decode=2",
                    "--embedding-block-size",
                    "4",
                    "--embedding-default-blocks",
                    "1",
                    "--embedding-max-grant-blocks",
                    "1",
                ],
                _drive_a,
            )
            nursery.start_soon(
                _run_node,
                second,
                sockets / "b.sock",
                ["--replicas", "prefill=1,decode=1", "--prefix-cache-blocks", "2"],
                _drive_b,
            )

    try:
        trio.run(both)
        yield first, second
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _summary(paths: list[Path], *, label_logs: bool = False) -> Summary:
    entries, logs = read_entries(paths, label_logs=label_logs)
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    return summarize(aggregator, logs=logs.stats, warnings=logs.warnings())


def _sent_rounds(run: NodeRun) -> Counter[tuple[str, int]]:
    return Counter(
        (transfer.kind, transfer.rounds) for result in run.results for transfer in result.transfers
    )


def _summary_rounds(summary: Summary) -> Counter[tuple[str, int]]:
    found: Counter[tuple[str, int]] = Counter()
    for row in summary.transfers:
        for rounds, count in row.rounds.items():
            found[(row.kind, rounds)] += count
    return found


def test_the_nodes_exit_cleanly(runs: tuple[NodeRun, NodeRun]) -> None:
    for run in runs:
        assert run.exit_code == 0, run.log.with_suffix(".stderr").read_text()


def test_summary_counts_match_what_the_test_sent(runs: tuple[NodeRun, NodeRun]) -> None:
    run, _ = runs
    summary = _summary([run.log])
    assert summary.warnings == []
    assert len(run.results) == 6 and run.errors == Counter({"bad_request": 2})
    requests = summary.requests
    assert requests.arrived == run.generates == 7
    assert requests.finished_stop + requests.finished_length == len(run.results)
    assert requests.finished_length == sum(result.finish_reason == "length" for result in run.results)
    assert requests.failed == 1 and requests.cancelled == 0
    assert requests.generated_tokens == sum(len(result.token_ids) for result in run.results)
    assert _summary_rounds(summary) == _sent_rounds(run)
    assert _sent_rounds(run)[("embedding", 4)] == 2  # the images needed REQUEST_MORE_CACHE rounds
    assert {row.code: row.count for row in summary.errors} == dict(run.errors)
    assert {row.phase for row in summary.latency} >= {
        "queued",
        "encode",
        "prefill",
        "kv_transfer",
        "ttft",
        "e2e",
    }


def test_the_metrics_op_returned_the_same_counters_live(runs: tuple[NodeRun, NodeRun]) -> None:
    run, _ = runs
    assert run.metrics is not None
    entries, _ = read_entries([run.log])
    aggregator = Aggregator()
    for entry in entries:  # nothing after the metrics op changes a counter: no request came after it
        aggregator.add(entry.event)
    from_log = metrics_result(aggregator, id=run.metrics.id, uptime_s=run.metrics.uptime_s)
    assert run.metrics.requests == from_log.requests
    assert run.metrics.tokens == from_log.tokens
    assert run.metrics.transfers == from_log.transfers
    assert run.metrics.errors == from_log.errors


def test_a_truncated_real_log_still_summarises(runs: tuple[NodeRun, NodeRun], tmp_path: Path) -> None:
    run, _ = runs
    data = run.log.read_bytes()
    cut = tmp_path / "crashed.jsonl"
    middle = len(data) * 2 // 3
    while data[middle - 1 : middle] == b"\n":
        middle += 1
    cut.write_bytes(data[:middle])
    summary = _summary([cut])
    assert summary.logs[0].truncated_bytes > 0
    assert "the last line is cut off" in summary.warnings[0]
    assert 0 < summary.requests.arrived <= 7
    assert main(["summary", str(cut)]) == 0


def test_two_real_nodes_logs_merge(runs: tuple[NodeRun, NodeRun]) -> None:
    first, second = runs
    merged = _summary([first.log, second.log], label_logs=True)
    assert merged.warnings == []
    assert merged.requests.arrived == first.generates + second.generates
    assert merged.requests.finished_stop + merged.requests.finished_length == len(first.results) + len(
        second.results
    )
    assert _summary_rounds(merged) == _sent_rounds(first) + _sent_rounds(second)
    replicas = {row.replica for row in merged.states}
    assert {"node-a/decode-1", "node-b/decode-0", "node-b/prefill-0"} <= replicas
    unlabelled = _summary([first.log, second.log])
    assert any("were started by several logs" in warning for warning in unlabelled.warnings)


def test_timeline_has_the_states_the_test_drove_and_the_png_is_written(
    runs: tuple[NodeRun, NodeRun], tmp_path: Path
) -> None:
    run, _ = runs
    entries, _ = read_entries([run.log])
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    timeline: Timeline = build_timeline(aggregator)
    lanes = {lane.replica: lane for lane in timeline.lanes}
    assert set(lanes) == {"encode-0", "prefill-0", "decode-0", "decode-1"}
    decode_1 = [segment.state for segment in lanes["decode-1"].segments]
    driven = run.driven["decode-1"]
    assert decode_1[-len(driven) :] == driven
    assert [lock.reasons for lock in lanes["decode-1"].locks] == [["manual"]]
    assert len(timeline.requests) == run.generates
    picture = tmp_path / "timeline.png"
    assert main(["timeline", str(run.log), "-o", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(picture) > 1000


def test_the_prefix_cache_table_counts_the_hits_and_evictions_of_the_run(
    runs: tuple[NodeRun, NodeRun],
) -> None:
    _, run = runs
    summary = _summary([run.log])
    [row] = summary.prefix
    assert row.replica == "prefill-0" and row.prompts == run.generates == 5
    assert row.hit_tokens == 32  # the repeated prompt's two full blocks (its last token always runs)
    assert row.prompt_tokens == sum(result.prompt_tokens for result in run.results)
    assert row.hit_tokens == sum(result.cached_tokens for result in run.results)
    assert row.hit_rate == 32 / row.prompt_tokens
    assert row.evicted_blocks == 2 and row.cached_blocks == 2  # the last prompt's blocks
    assert main(["summary", str(run.log)]) == 0
