"""`python -m engine.node`: serve a model with disaggregated replicas behind a JSON-lines control socket.

This is the entry point, where the node is composed: the core (`engine.core`: model host, replicas,
router, controller) and the control handler (`engine.service`), and around them, as configured, the
cluster member (`engine.cluster`), the planner (`engine.planner`), the HTTP API (`engine.http`) and the
demo (`engine.demo`). None of those parts imports this module or each other's node; each gets the core,
or a small protocol, here.

Startup: read the config (flags, TOML, environment — the only place the environment is read), open the
event log, create the replicas and command each into `Loading*`, start the controller and the control
server, and print one JSON line `{"listening": ADDRESS}` on stdout. Requests sent while replicas still
load wait in the queue.

Shutdown (SIGINT, SIGTERM or the `shutdown` op): stop admitting, let in-flight requests finish within
`--shutdown-drain-deadline`, cancel the rest, stop the replicas, check every pool for leaked blocks and
exit 0 — or 1 when blocks leaked. A second signal exits at once (code 130).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import final

import msgspec
import trio

from engine.cluster.join import new_member
from engine.cluster.local_etcd import LocalEtcdError
from engine.cluster.member import ClusterMember
from engine.cluster.membership import JoinRefused
from engine.cluster.peers import PeerListenError
from engine.config import ConfigError, NodeConfig, parse_node_config
from engine.config.address import Address
from engine.control.outbox import ReplySink
from engine.control.server import ControlServer, ControlServerError
from engine.core import NodeCore
from engine.generate.served import ServedModel
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
from engine.service import NodeService
from engine.summary import log_summaries
from messages.control import ControlRequest
from messages.log.events import NodeConfigured, NodeStarted, NodeStopping
from replicas.actor.supervisor import ReplicaStartFailed, root_cause
from replicas.directory import ReplicaDirectory
from replicas.model import ModelLoadError
from replicas.weights import ModelHost
from transport.auth.credentials import CredentialError
from transport.memory.host_memory import tune_allocator

VERSION = "0.1.0"
# What stops a node from coming up; `main` prints it in one line and exits 2.
_LOADING = (ModelLoadError, LogFileError, ReplicaStartFailed, ConfigError, JoinRefused, LocalEtcdError)
STARTUP_ERRORS = (*_LOADING, CredentialError, ControlServerError, HttpServerError, PeerListenError)


@final
class Node:
    """One node as `python -m engine.node` serves it (see the module docstring): the core, and around
    it, as configured, the cluster member, the planner and the HTTP API."""

    def __init__(
        self, config: NodeConfig, log: EventLog, aggregator: Aggregator, metrics: NodeMetrics
    ) -> None:
        """`aggregator.add` and `metrics.observe` must be observers of `log` (`open_event_log`)."""
        self.config = config
        self.log = log
        self.metrics = metrics
        self.member: ClusterMember | None = None
        self.core = core = NodeCore(config, log, decides=self._decides, load=lambda: metrics.load.totals)
        # In a cluster (`--cluster URL`): this node's membership, peer links and cross-node requests.
        if core.clustered:
            self.member = new_member(core, handle=self._handle, load=lambda: metrics.load.totals)
        self.service = NodeService(core, aggregator, cluster=self.member, token_gap=metrics.token_gap)
        # `--autoscale`: the planner (on the cluster's leader, or on this node alone).
        self.planner: Planner | None = None
        if config.autoscale.autoscale:
            planner = self.planner = Planner(core, metrics.load, cluster=self.member)
            self.service.scaled_manually.subscribe(lambda _: planner.manual_scale())
        metrics.attach(core.directory, lambda: core.router.live, lambda: len(core.router.pending))

    def _decides(self) -> bool:
        """Whether this node's controller decides now: alone, always; in a cluster, while it leads."""
        return self.member is None or self.member.is_leader

    async def _handle(self, request: ControlRequest, replies: ReplySink) -> None:
        await self.service.handle(request, replies)

    @property
    def host(self) -> ModelHost:
        return self.core.host

    @property
    def served(self) -> ServedModel:
        return self.core.served

    def release_replicas(self) -> None:
        self.core.release_replicas()

    @property
    def router(self) -> Router:
        return self.core.router

    @property
    def directory(self) -> ReplicaDirectory:
        return self.core.directory

    @property
    def clustered(self) -> bool:
        return self.member is not None

    @property
    def control_address(self) -> str | None:
        return self.core.control_address

    @property
    def http_url(self) -> str | None:
        return self.core.http_url

    def request_shutdown(self, detail: str, reason: str = "shutdown_op") -> None:
        self.core.request_shutdown(detail, reason)

    async def serve(self, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED) -> int:
        """Run until shutdown; returns the exit code (0, or 1 when blocks leaked)."""
        config, core = self.config, self.core
        async with trio.open_nursery() as nursery:
            if self.member is not None:
                await nursery.start(self.member.run)  # joins (or raises JoinRefused) first
            await core.start_replicas(nursery)
            nursery.start_soon(core.controller.run)
            if self.planner is not None:
                nursery.start_soon(self.planner.run)
            nursery.start_soon(core.router.expire_waiting)
            if config.log.summary_period > 0:
                summaries = partial(log_summaries, self.log, core.directory, core.router, self.metrics.tally)
                nursery.start_soon(summaries, config.log.summary_period)
            nursery.start_soon(self._watch_signals)
            server = ControlServer(self.service, config.control, self.log, core.control_token)
            address = await nursery.start(server.serve, config.listen_address)
            core.control_address = str(address)
            http = config.http_address
            if http is not None:
                api = HttpApi(
                    core,
                    self.metrics,
                    api_key=config.api_key,
                    tool_call_parser=config.tool_call_parser,
                )
                access = None if config.disable_log_requests else self.log
                core.http_url = await nursery.start(partial(serve_http, api, *http, access=access))
            self.log.emit(NodeConfigured(config=msgspec.to_builtins(config)))
            self.log.emit(
                NodeStarted(
                    listen=str(address),
                    http=core.http_url,
                    model=core.host.name,
                    device=config.device,
                    transport=config.transport,
                    replicas=list(core.directory),
                    pid=os.getpid(),
                    version=VERSION,
                )
            )
            task_status.started(address)
            await core.wait_shutdown()
            await core.drain(server)
            nursery.cancel_scope.cancel()
        return core.finish()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self.core.shutting_down:
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
    tune_allocator()  # a step's temporaries reuse the heap; the heap stays bounded
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
