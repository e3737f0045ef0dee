"""`python -m engine.node`: serve a model with disaggregated replicas behind a JSON-lines control socket.

Startup: read the config (flags, TOML, environment — the only place the environment is read), open the
event log, create the replicas and command each into `Loading*`, start the controller and the control
server, and print one JSON line `{"listening": ADDRESS}` on stdout. Requests sent while replicas still
load wait in the queue.

Shutdown (SIGINT, SIGTERM or the `shutdown` op): stop admitting, let in-flight requests finish within
`--shutdown-drain-deadline`, cancel the rest, stop the replicas, check every pool for leaked blocks and
exit 0 — or 1 when blocks leaked. A second signal exits at once (code 130).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import final

import msgspec
import torch
import trio

from engine.cluster.join import new_member
from engine.cluster.local_etcd import LocalEtcdError
from engine.cluster.member import ClusterMember
from engine.cluster.membership import JoinRefused
from engine.cluster.peers import PeerListenError
from engine.config import ConfigError, NodeConfig, ReplicaCounts, parse_node_config
from engine.control.address import Address
from engine.control.server import ControlServer, ControlServerError
from engine.controller import Controller
from engine.http.app import HttpApi
from engine.http.metrics import NodeMetrics
from engine.http.server import HttpServerError, serve_http
from engine.logging import (
    EventLog,
    LogFileError,
    configure_diagnostics,
    node_console_level,
    open_event_log,
    route_diagnostics,
)
from engine.logs import Aggregator
from engine.planner.loop import Planner
from engine.router import Router
from engine.served import served_model
from engine.service import NodeService
from engine.summary import log_summaries
from messages.cluster import ClusterIdentity
from messages.commands import Transition
from messages.log.events import NodeConfigured, NodeStarted, NodeStopped, NodeStopping, PoolLeak
from replicas.actor import Replica
from replicas.emulation import EmulatedSpeed
from replicas.fabric import Fabric
from replicas.inbox import new_command_id
from replicas.model import ModelLoadError
from replicas.services import ReplicaServices, ReplicaSettings
from replicas.states import LOADING_STATE, ROLES, Role
from replicas.supervisor import ReplicaStartFailed, root_cause, supervise
from replicas.weights import ModelHost
from transport.config import TransferConfig
from transport.memory.host_memory import return_large_frees

VERSION = "0.1.0"
SETTLE_SECONDS = 5.0
# What stops a node from coming up; `main` prints it in one line and exits 2.
_LOADING = (ModelLoadError, LogFileError, ReplicaStartFailed, ConfigError, JoinRefused, LocalEtcdError)
STARTUP_ERRORS = (*_LOADING, ControlServerError, HttpServerError, PeerListenError)  # addresses


def replica_settings(config: NodeConfig, context: int) -> ReplicaSettings:
    """The replicas' sizes and limits; pool defaults hold one maximum-context request (architecture §4):
    `context` tokens, the model's or `--max-model-len`."""
    transfer = config.transfer
    common = {
        "progress_timeout": transfer.progress_timeout,
        "pressure_timeout": transfer.grant_wait_timeout,
        "heartbeat_interval": transfer.heartbeat_interval,
        "link_timeout": max(5.0, 5 * transfer.heartbeat_interval),
        "ucx_copies": transfer.ucx_copies,
        "ucx_read_lanes": transfer.ucx_read_lanes,
    }
    return ReplicaSettings(
        kv_block_size=config.kv.block_size,
        kv_pool_blocks=config.kv.pool_blocks or math.ceil(context / config.kv.block_size),
        embedding_block_size=config.embedding.block_size,
        embedding_pool_blocks=config.embedding.pool_blocks
        or math.ceil(context / config.embedding.block_size),
        embedding_default_blocks=config.embedding.default_blocks,
        embedding_max_grant_blocks=config.embedding.max_grant_blocks,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        max_batch_size=config.scheduler.max_batch_size,
        migration_wait=config.scheduler.migration_wait,
        emulated=config.emulated_speed or EmulatedSpeed(),
        old_prefill_serves_queue=config.scheduler.old_prefill_serves_queue,
        attention=config.executor.attention,
        cuda_graphs=config.executor.cuda_graphs,
        kv_transfer=TransferConfig(**common),  # type: ignore[arg-type]
        embedding_transfer=TransferConfig(
            default_grant_blocks=config.embedding.default_blocks,
            round_cap_blocks=config.embedding.max_grant_blocks,
            **common,  # type: ignore[arg-type]
        ),
    )


def default_counts(host: ModelHost) -> ReplicaCounts:
    vision = host.config.image_token_id is not None
    return ReplicaCounts(encode=1 if vision else 0, prefill=1, decode=1)


@final
class Node:
    """One node: its replicas, router, controller and control server (see the module docstring)."""

    def __init__(
        self, config: NodeConfig, log: EventLog, aggregator: Aggregator, metrics: NodeMetrics
    ) -> None:
        """`aggregator.add` and `metrics.observe` must be observers of `log` (`open_event_log`)."""
        self.config = config
        self.log = log
        dtype = config.dtype or ("float32" if config.device == "cpu" else "bfloat16")
        self.host = ModelHost(
            config.model,
            device=config.device,
            dtype=dtype,
            cache_dir=config.model_cache,
            batch_invariant=config.executor.batch_invariant,
        )
        self.served = served_model(config, self.host)  # ConfigError: --max-model-len, --chat-template
        self.counts = config.replicas or default_counts(self.host)
        clustered = config.cluster.cluster is not None
        self.node_id = config.cluster.node_id or f"node-{os.getpid()}"
        self.services = ReplicaServices(
            settings=replica_settings(config, self.served.context),
            host=self.host,
            fabric=Fabric(config.transport, clustered=clustered, host=config.cluster.cluster_host),
            log=log,
            faults=list(config.faults),
        )
        self.router = Router(
            self.services, max_queue=config.scheduler.max_queue, queue_wait=config.scheduler.queue_wait
        )
        self.service = NodeService(self, self.services, self.router, aggregator)
        # In a cluster (`--cluster URL`): this node's membership, peer links and cross-node requests.
        self.member: ClusterMember | None = new_member(self) if clustered else None
        member = self.member
        self.controller = Controller(
            self.services,
            config.controller,
            decides=lambda: member is None or member.membership.is_leader,
        )
        self.metrics = metrics
        # `--autoscale`: the planner (on the cluster's leader, or on this node alone).
        self.planner: Planner | None = Planner(self) if config.autoscale.autoscale else None
        self.metrics.attach(self.services, lambda: len(self.router.pending))
        self.http_url: str | None = None  # set once the HTTP API listens
        self.control_address: str | None = None  # set once the control socket listens
        self.drain_deadline = config.shutdown.drain_deadline
        self.started = time.monotonic()
        self._shutdown = trio.Event()
        self._shutdown_reason: tuple[str, str] = ("shutdown_op", "")
        self._replica_nursery: trio.Nursery | None = None
        self._indices = {role: itertools.count(0) for role in ROLES}
        # Held by a `scale` op while it runs (`engine.scaling`): scales apply one after another.
        self.scale_lock = trio.Lock()

    def identity(self) -> ClusterIdentity:
        """What every node of this node's cluster must serve alike."""
        return ClusterIdentity(
            model=self.host.name,
            dtype=str(self.host.dtype).removeprefix("torch."),
            kv_block_size=self.config.kv.block_size,
            embedding_block_size=self.config.embedding.block_size,
        )

    def request_shutdown(self, detail: str, reason: str = "shutdown_op") -> None:
        if not self._shutdown.is_set():
            self._shutdown_reason = (reason, detail)
            self._shutdown.set()

    async def add_replica(self, role: Role) -> Replica:
        """Create replica `{role}-{n}` (Inactive), start its supervised task, and only then make it one of
        the node's replicas. Raises `ReplicaStartFailed` (the replica never listed) when it cannot start.

        Listed while it started, an `Inactive` replica could be commanded by others (a `transition`, or
        another `scale` starting `Inactive` replicas) before the caller's own command reached it, which
        was then refused. Listed after, with no checkpoint before the caller posts its command, the
        caller's command is the first the replica handles."""
        assert self._replica_nursery is not None
        prefix = "" if self.member is None else f"{self.node_id}/"
        index = next(self._indices[role])
        while f"{prefix}{role}-{index}" in self.services.replicas:
            index = next(self._indices[role])
        replica = Replica(f"{prefix}{role}-{index}", role, self.services)
        await self._replica_nursery.start(supervise, replica)
        self.services.replicas[replica.name] = replica
        return replica

    def _check_kernels(self) -> None:
        executor = self.config.executor
        cpu = self.config.device == "cpu"
        if (
            executor.attention == "torch" or (cpu and executor.attention == "auto")
        ) and not executor.batch_invariant:
            return
        from replicas.model.gpu.check import kernels_problem
        from transport.memory.storage import torch_dtype

        config = self.host.config
        device = torch.device(self.config.device)
        with contextlib.nullcontext() if cpu else torch.cuda.device(device):
            kernels_problem(
                device,
                torch_dtype(config.dtype),
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                invariant=executor.batch_invariant,
            )

    async def serve(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> int:
        """Run until shutdown; returns the exit code (0, or 1 when blocks leaked)."""
        config = self.config
        async with trio.open_nursery() as nursery:
            self._replica_nursery = nursery
            if self.member is not None:
                await nursery.start(self.member.run)  # joins (or raises JoinRefused) first
            # The kernels' start-up check compiles them (seconds on a GPU): once, in a worker thread, before
            # any replica builds an executor on the event loop (they then find its cached verdict).
            await trio.to_thread.run_sync(self._check_kernels)
            for role in ROLES:
                for _ in range(getattr(self.counts, role)):
                    await self.add_replica(role)
            for replica in list(self.services.replicas.values()):
                replica.tell(
                    Transition(
                        command_id=new_command_id(), to=LOADING_STATE[replica.role].value, origin="node"
                    )
                )
            nursery.start_soon(self.controller.run)
            if self.planner is not None:
                nursery.start_soon(self.planner.run)
            nursery.start_soon(self.router.expire_waiting)
            if config.log.summary_period > 0:
                summaries = partial(log_summaries, self.log, self.services, self.metrics.tally)
                nursery.start_soon(summaries, lambda: len(self.router.pending), config.log.summary_period)
            nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            server = ControlServer(self.service, config.control, self.log)
            address = await nursery.start(server.serve, config.listen_address)
            self.control_address = str(address)
            http = config.http_address
            if http is not None:
                api = HttpApi(self, self.metrics, api_key=config.api_key)
                self.http_url = await nursery.start(partial(serve_http, api, *http))
            self.log.emit(NodeConfigured(config=msgspec.to_builtins(config)))
            self.log.emit(
                NodeStarted(
                    listen=str(address),
                    http=self.http_url,
                    model=self.host.name,
                    device=config.device,
                    transport=config.transport,
                    replicas=list(self.services.replicas),
                    pid=os.getpid(),
                    version=VERSION,
                )
            )
            task_status.started(address)
            await self._shutdown.wait()
            await self._drain(server)
            nursery.cancel_scope.cancel()
        return self._finish()

    async def _drain(self, server: ControlServer) -> None:
        reason, detail = self._shutdown_reason
        requests = self.services.requests
        self.log.emit(NodeStopping(reason=reason, detail=detail, in_flight=len(requests)))  # type: ignore[arg-type]
        self.router.accepting = False
        server.stop_accepting()
        with trio.move_on_after(self.drain_deadline):
            await self.router.wait_idle()
            # The handlers relay the final updates: closing before they did lost those results.
            await server.wait_requests_done()
        for request in list(requests.values()):
            request.cancel_reason = "shutdown"
            self.router.cancel(request.request_id)
        with trio.move_on_after(SETTLE_SECONDS):
            await self.router.wait_idle()
            await server.wait_requests_done()
        server.close()
        await server.wait_closed()  # the final replies are sent (bounded by the write timeout)

    def release_replicas(self) -> None:
        """After `serve` returned: let the stopped replicas go, and with them their pools' memory."""
        assert self._shutdown.is_set(), "release_replicas before the node stopped"
        self.services.replicas.clear()

    def _finish(self) -> int:
        leaked = 0
        for replica in self.services.replicas.values():
            for pool, owners in replica.pools.leaks().items():
                blocks = sum(owners.values())
                leaked += blocks
                self.log.bind(replica=replica.name).emit(
                    PoolLeak(pool=pool, leaked_blocks=blocks, owners=owners)
                )
        code = 1 if leaked else 0
        self.log.emit(
            NodeStopped(exit_code=code, leaked_blocks=leaked, uptime_s=time.monotonic() - self.started)
        )
        return code

    async def _watch_signals(self, node_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self._shutdown.is_set():
                    self.log.emit(
                        NodeStopping(reason="signal", detail="second signal: exiting at once", in_flight=0)
                    )
                    self.log.close()
                    os._exit(130)
                self.request_shutdown(f"signal {signal.Signals(signum).name}", reason="signal")


async def run_node(config: NodeConfig, *, demo: bool = False) -> int:
    if demo and config.cluster.nodes > 1 and config.cluster.cluster is None:
        # The demo across node processes: a local etcd, child nodes, and this process as node-0 (which
        # comes back here with `cluster` set).
        from engine.cluster.demo import run_cluster_demo

        return await run_cluster_demo(config, partial(run_node, demo=True))
    aggregator = Aggregator(keep_requests=False)
    metrics = NodeMetrics()
    log = open_event_log(
        file=config.log.file,
        level=config.log.level,
        console=sys.stderr if config.log.console else None,
        console_level=node_console_level(config.log.level),
        observers=[aggregator.add, metrics.observe],
    )
    route_diagnostics(log)
    try:
        node = Node(config, log, aggregator, metrics)
        if not demo:
            exit_code = 0

            async def serve(task_status: trio.TaskStatus[Address]) -> None:
                nonlocal exit_code
                exit_code = await node.serve(task_status=task_status)

            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve)
                line = {"listening": str(address), "http": node.http_url}
                print(msgspec.json.encode(line).decode(), flush=True)
            return exit_code
        from engine.demo import run_demo

        return await run_demo(node)
    finally:
        route_diagnostics(None)
        log.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        config = parse_node_config(args, os.environ)
    except ConfigError as exc:
        print(f"engine.node: {exc}", file=sys.stderr)
        return 2
    configure_diagnostics(config.log.level, stream_level=node_console_level(config.log.level))
    return_large_frees()  # a batch's large temporaries go back to the system when it ends
    if config.demo and config.listen == NodeConfig().listen:
        config = msgspec.structs.replace(config, listen="127.0.0.1:0")
    if config.demo and config.http == NodeConfig().http and config.port is None:
        config = msgspec.structs.replace(config, http="127.0.0.1:0")
    try:
        return trio.run(partial(run_node, config, demo=config.demo))
    except (*STARTUP_ERRORS, BaseExceptionGroup) as exc:
        error = root_cause(exc)  # as nurseries wrapped it on its way out
        if not isinstance(error, STARTUP_ERRORS):
            raise
        line = str(error)
        if isinstance(error, ControlServerError):
            line = f"the control socket {line}; choose another address with --listen (port 0: any free one)"
        print(f"engine.node: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
