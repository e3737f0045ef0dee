"""A chaos run: a cluster of hosts under load while a seeded schedule of faults hits it, then the checks.

`run_chaos(directory, config)`:
1. starts etcd and the nodes, each on its own host (`engine.hosts.cluster`: network namespaces; the
   default layout is the operator's — prefill nodes on hosts a and b, decode nodes on c and d), with
   `--transport tcp --lease-ttl T --emulated-speed decode_steps_per_s=S`, and waits until every node
   lists every replica of the cluster serving;
2. runs `clients` clients (`engine.chaos.load`) for `seconds`, while the schedule's faults
   (`engine.chaos.schedule`) happen one after another — each ends (link restored, node listening
   again, etcd healthy) before the next starts;
3. from the moment the last fault ended, sends a probe request to every node until each has served one
   (`serve_again_s`: per node, the seconds until its first probe's result; None when none came within
   `serve_bound_s`) — the clients keep going meanwhile;
4. after the load: every node must serve a probe again, and every replica must come back idle — no
   block held, nothing queued (`blocks_held`: what each replica still held once
   `idle_bound_s` passed).

Everything a check needs is in the returned `ChaosReport`; the tokens of the results are held to the
model run in one piece by the caller (`check_tokens`, or the tests' own `check_outcome`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, final

import structlog
import trio

from engine.chaos.load import LoadShape, Record, run_client
from engine.chaos.schedule import Fault, FaultKind, make_schedule
from engine.client import ControlClient, ControlClientError, ControlError
from engine.hosts.cluster import HostCluster, NodeSpec, open_host_cluster
from engine.verify import compare
from messages.control_replies import StatusResult
from replicas.model import Model, SamplingParams

_log = structlog.get_logger("engine.chaos")
SERVING: Final = frozenset({"Prefill", "Decode", "Encode"})
READY_S: Final = 120.0
POLL_S: Final = 0.2
PROBE: Final = (tuple(range(40, 72)), 4)  # 32 prompt tokens (two KV blocks), 4 new tokens
OPERATOR_LAYOUT: Final = (
    NodeSpec("pa", "a", "prefill=1,decode=0"),
    NodeSpec("pb", "b", "prefill=1,decode=0"),
    NodeSpec("dc", "c", "prefill=0,decode=1"),
    NodeSpec("dd", "d", "prefill=0,decode=1"),
)


@final
@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 46
    seconds: float = 120.0
    period_s: float = 12.0
    partition_s: float = 6.0
    lease_ttl: int = 3
    clients: int = 6
    kinds: tuple[FaultKind, ...] | None = None  # None: as many as fit, drawn by the seed
    decode_steps_per_s: int = 40
    layout: tuple[NodeSpec, ...] = OPERATOR_LAYOUT
    shape: LoadShape = field(default_factory=LoadShape)
    serve_bound_s: float = 90.0
    idle_bound_s: float = 60.0
    extra_options: tuple[str, ...] = ()


@final
@dataclass(slots=True)
class FaultRun:
    fault: Fault
    target: str  # the node or host it hit (the leader's id for `leader`)
    started_s: float = 0.0
    ended_s: float = 0.0


@final
@dataclass(slots=True)
class ChaosReport:
    config: ChaosConfig
    faults: list[FaultRun] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    serve_again_s: dict[str, float | None] = field(default_factory=dict)
    serves_after: dict[str, str] = field(default_factory=dict)  # node -> "ok" or why not, after the load
    blocks_held: dict[str, int] = field(default_factory=dict)  # replica -> used blocks at the end
    queued: dict[str, int] = field(default_factory=dict)  # replica -> queued work at the end
    members: dict[str, list[str]] = field(default_factory=dict)  # node -> the members it lists
    log_dir: Path | None = None
    started: float = 0.0  # `time.monotonic()` when the load began: `FaultRun` times count from it

    def outcomes(self) -> Counter[str]:
        return Counter(r.outcome for r in self.records)

    def error_codes(self) -> Counter[str]:
        return Counter(r.code or "" for r in self.records if r.outcome == "error")

    @property
    def time_to_serve_s(self) -> float | None:
        """Seconds from the end of the last fault until every node had served a probe (None: one did not)."""
        values = list(self.serve_again_s.values())
        return (
            None if not values or any(v is None for v in values) else max(v for v in values if v is not None)
        )

    def summary(self) -> list[str]:
        """The counts, one fact a line."""
        outcomes = self.outcomes()
        codes = ", ".join(f"{code} {count}" for code, count in self.error_codes().most_common()) or "none"
        serve = self.time_to_serve_s
        return [
            f"seed {self.config.seed}; {len(self.faults)} faults: "
            + "; ".join(f"{f.started_s:.1f}s {f.fault.kind} {f.target}" for f in self.faults),
            f"requests {len(self.records)}: results {outcomes['result']}, errors {outcomes['error']} "
            f"({codes}), unreachable {outcomes['unreachable']}, connection lost {outcomes['connection_lost']}, "
            f"no end {outcomes['no_end']}",
            "time to serve again after the last fault: "
            + ("not within the bound" if serve is None else f"{serve:.1f} s")
            + " ("
            + ", ".join(f"{n} {'-' if s is None else f'{s:.1f}'}" for n, s in self.serve_again_s.items())
            + ")",
            "after the load every node serves: "
            + ", ".join(f"{node} {verdict}" for node, verdict in self.serves_after.items()),
            f"blocks held after the load: {sum(self.blocks_held.values())}"
            + (
                " (" + ", ".join(f"{r} {b}" for r, b in self.blocks_held.items() if b) + ")"
                if any(self.blocks_held.values())
                else ""
            ),
        ]


def check_tokens(model: Model, records: Sequence[Record]) -> list[str]:
    """Every result's tokens against the model run in one piece (`engine.verify.compare`); the problems."""
    problems = []
    for record in records:
        result = record.result
        if result is None:
            continue
        verdict = compare(
            model, record.prompt, result.token_ids, sampling=SamplingParams(), max_tokens=record.max_tokens
        )
        if not verdict.accepted:
            problems.append(
                f"{result.request_id} on {record.node}: tokens {result.token_ids} differ from the model run "
                f"in one piece {verdict.reference} at {verdict.first_difference}"
            )
        streamed = [token for reply in record.streamed for token in reply.token_ids]
        if record.stream and streamed != result.token_ids:
            problems.append(f"{result.request_id}: streamed {streamed}, result {result.token_ids}")
    return problems


async def run_chaos(directory: Path, config: ChaosConfig) -> ChaosReport:
    """See the module docstring."""
    report = ChaosReport(config, log_dir=directory / "logs")
    options = [
        "--transport",
        "tcp",
        "--lease-ttl",
        str(config.lease_ttl),
        "--emulated-speed",
        f"decode_steps_per_s={config.decode_steps_per_s}",
        *config.extra_options,
    ]
    hosts = list(dict.fromkeys(spec.host for spec in config.layout))
    schedule = make_schedule(
        config.seed,
        seconds=config.seconds,
        period_s=config.period_s,
        hosts=hosts,
        nodes=[spec.node_id for spec in config.layout],
        kinds=config.kinds,
    )
    replicas = sum(_count(spec.replicas) for spec in config.layout)
    async with open_host_cluster(directory, config.layout, options=options) as cluster:
        for node in cluster.nodes.values():
            assert node.address is not None
            await _wait_status(
                node.address, cluster.token, lambda s: _serving(s, replicas), "every replica serving", READY_S
            )
        stop = trio.Event()
        started = report.started = time.monotonic()

        def live() -> list[tuple[str, str]]:
            return [(n.node_id, n.address) for n in cluster.nodes.values() if n.running and n.address]

        async with trio.open_nursery() as clients:
            for index in range(config.clients):
                clients.start_soon(
                    run_client, index, config.seed, live, report.records, stop, config.shape, cluster.token
                )
            for fault in schedule:
                await trio.sleep_until(
                    trio.current_time() + max(0.0, started + fault.at_s - time.monotonic())
                )
                run = FaultRun(fault, fault.target, started_s=time.monotonic() - started)
                _log.info("chaos.fault", fault=fault.describe())
                await _apply(cluster, config, run)
                run.ended_s = time.monotonic() - started
                report.faults.append(run)
            healed = time.monotonic()
            async with trio.open_nursery() as probes:
                for node_id in cluster.nodes:
                    probes.start_soon(_serve_again, cluster, node_id, healed, config.serve_bound_s, report)
            await trio.sleep_until(
                trio.current_time() + max(0.0, started + config.seconds - time.monotonic())
            )
            stop.set()
        for node_id in cluster.nodes:
            report.serves_after[node_id] = await _probe_once(cluster, node_id, config.serve_bound_s)
        await _idle(cluster, config.idle_bound_s, report)
    return report


async def _apply(cluster: HostCluster, config: ChaosConfig, run: FaultRun) -> None:
    fault = run.fault
    lease_s = config.lease_ttl + 30.0
    match fault.kind:
        case "partition":
            await cluster.cut(fault.target)
            await trio.sleep(config.partition_s)
            await cluster.restore(fault.target)
        case "kill":
            await cluster.kill(fault.target)
            await cluster.restart(fault.target, lease_seconds=lease_s)
        case "etcd":
            await cluster.restart_etcd(hard=True)
        case "leader":
            leader = await _leader(cluster)
            run.target = leader
            await cluster.kill(leader)
            await cluster.restart(leader, lease_seconds=lease_s)


async def _leader(cluster: HostCluster) -> str:
    """The node that leads now, as the running nodes' `status` tells."""
    for node in cluster.nodes.values():
        if node.running and node.address:
            try:
                with trio.fail_after(10):
                    async with ControlClient.connect(node.address, token=cluster.token) as client:
                        status = await client.status()
            except (OSError, trio.TooSlowError, ControlClientError):
                continue
            if status.cluster is not None and status.cluster.leader in cluster.nodes:
                return status.cluster.leader
    return next(iter(cluster.nodes))


async def _serve_again(
    cluster: HostCluster, node_id: str, healed: float, bound_s: float, report: ChaosReport
) -> None:
    report.serve_again_s[node_id] = None
    with trio.move_on_after(bound_s):
        while True:
            verdict = await _probe_once(cluster, node_id, bound_s)
            if verdict == "ok":
                report.serve_again_s[node_id] = time.monotonic() - healed
                return
            await trio.sleep(POLL_S)


async def _probe_once(cluster: HostCluster, node_id: str, bound_s: float) -> str:
    """Send the probe request to `node_id`: "ok", or what went wrong."""
    node = cluster.nodes[node_id]
    if not node.running or not node.address:
        return "not running"
    prompt, max_tokens = PROBE
    try:
        with trio.fail_after(bound_s):
            async with ControlClient.connect(node.address, token=cluster.token) as client:
                await client.generate_result(input_ids=list(prompt), max_tokens=max_tokens, ignore_eos=True)
    except ControlError as exc:
        return f"{exc.code}: {exc.message}"
    except (OSError, trio.TooSlowError, ControlClientError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def _idle(cluster: HostCluster, bound_s: float, report: ChaosReport) -> None:
    """Wait (up to `bound_s`) until every node's own replicas hold no block and queue nothing; record
    what they hold then, and the members each node lists."""
    statuses: dict[str, StatusResult] = {}
    with trio.move_on_after(bound_s):
        while True:
            for node in cluster.nodes.values():
                if node.address:
                    try:
                        async with ControlClient.connect(node.address, token=cluster.token) as client:
                            statuses[node.node_id] = await client.status()
                    except (OSError, ControlClientError):
                        continue
            if len(statuses) == len(cluster.nodes) and all(
                _idle_here(status, node_id) for node_id, status in statuses.items()
            ):
                break
            await trio.sleep(POLL_S)
    for node_id, status in statuses.items():
        for replica in status.replicas:
            if replica.node == node_id:
                report.blocks_held[replica.name] = replica.used_blocks
                report.queued[replica.name] = replica.work_queue + replica.migration_queue
        report.members[node_id] = [] if status.cluster is None else list(status.cluster.nodes)


def _idle_here(status: StatusResult, node: str) -> bool:
    return all(
        r.used_blocks == 0 and r.work_queue == 0 and r.migration_queue == 0
        for r in status.replicas
        if r.node == node
    )


def _serving(status: StatusResult, replicas: int) -> bool:
    return len(status.replicas) == replicas and all(r.state in SERVING for r in status.replicas)


async def _wait_status(
    address: str, token: bytes, predicate: object, what: str, seconds: float
) -> StatusResult:
    assert callable(predicate)
    last: StatusResult | None = None
    with trio.move_on_after(seconds):
        async with ControlClient.connect(address, token=token) as client:
            while True:
                last = await client.status()
                if predicate(last):
                    return last
                await trio.sleep(POLL_S)
    raise TimeoutError(f"{what} did not happen within {seconds:g} s at {address}; last status: {last}")


def _count(replicas: str) -> int:
    return sum(int(part.partition("=")[2]) for part in replicas.split(","))
