"""The node core: the model host, the replicas, the router and the controller of one node.

`NodeCore` builds what every node has and knows nothing of the parts the entry point (`engine.node`)
composes around it — the cluster member, the HTTP API, the planner, the demo; those are handed the core
(or a small protocol of it). Its parts are wired through constructors and events, never by writing
into each other: the replicas report readiness changes on the node-wide signal (`changes`, which the
router subscribes to and the scale op and the cluster's reports wait on) and give back work on an event
(`returned`, which the router subscribes to); the other nodes' replicas, in a cluster, come through the
directory (`ReplicaDirectory.serve_remote`).

Startup (`start_replicas`): the kernels' start-up check; on a CUDA device without `--kv-pool-blocks`,
the resident weights loaded and the KV pools sized by `--gpu-memory-utilization` (`engine.kv_sizing`);
then the replicas, each commanded into `Loading*`. Shutdown (`drain`, `finish`): stop admitting, let in-flight requests finish within
`--shutdown-drain-deadline`, cancel the rest, then check every pool for leaked blocks (exit code 1 when
any leaked).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Callable
from typing import Final, final

import structlog
import torch
import trio

from engine.config import NodeConfig, ReplicaCounts
from engine.config.credentials import node_credentials
from engine.control.server import ControlServer
from engine.controller import Controller
from engine.generate.served import served_model
from engine.kv_sizing import device_kv_settings
from engine.logging import EventLog
from engine.prefix_pull import PullEstimate
from engine.router import Router
from messages.cluster import ClusterIdentity, LoadTotals
from messages.commands import Transition
from messages.log.events import NodeStopped, NodeStopping, PoolLeak
from replicas.actor import Replica
from replicas.actor.supervisor import supervise
from replicas.directory import ReplicaDirectory
from replicas.emulation import EmulatedSpeed
from replicas.fabric import Fabric
from replicas.faults import FaultHooks
from replicas.inbox import new_command_id
from replicas.prefill.prefix import routing_keys
from replicas.request import ServingRequest
from replicas.settings import ReplicaSettings
from replicas.signals import Changes, Subscribers
from replicas.states import LOADING_STATE, ROLES, Role
from replicas.weights import ModelHost
from transport.auth.credentials import LinkAdmission
from transport.config import TransferConfig

SETTLE_SECONDS = 5.0
KV_SIZING_HOLDER: Final = "kv-sizing"  # holds the resident copy while the KV pools are sized
_log = structlog.get_logger("engine.core")


def replica_settings(
    config: NodeConfig, context: int, admission: LinkAdmission | None = None
) -> ReplicaSettings:
    """The replicas' sizes and limits; pool defaults hold one maximum-context request (architecture §4):
    `context` tokens, the model's or `--max-model-len`. `admission`: what admits their transfer links."""
    transfer = config.transfer
    common = {
        "admission": admission,
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
        prefix_cache=config.prefix.cache == "on",
        prefix_cache_blocks=config.prefix.cache_blocks,
        embedding_block_size=config.embedding.block_size,
        embedding_pool_blocks=config.embedding.pool_blocks
        or math.ceil(context / config.embedding.block_size),
        embedding_default_blocks=config.embedding.default_blocks,
        embedding_max_grant_blocks=config.embedding.max_grant_blocks,
        max_batch_tokens=config.scheduler.max_batch_tokens,
        chunk_tokens=_chunk_tokens(config.scheduler.prefill_chunk_tokens, config.scheduler.max_batch_tokens),
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
        weights_transfer=TransferConfig(admission=admission),
    )


DEFAULT_CHUNK_TOKENS: Final = 8192


def _chunk_tokens(chunk: int | None, max_batch_tokens: int) -> int | None:
    """`--prefill-chunk-tokens`: none — chunks of the batch budget, at least `DEFAULT_CHUNK_TOKENS`
    (docs/serving.md#chunked-prefill: on a prefill replica a chunk buys nothing below that and costs a
    batch each); 0 — off; else that many tokens, at most the batch budget."""
    if chunk is None:
        return max(max_batch_tokens, DEFAULT_CHUNK_TOKENS)
    return min(chunk, max_batch_tokens) or None


def default_counts(host: ModelHost) -> ReplicaCounts:
    vision = host.config.image_token_id is not None
    return ReplicaCounts(encode=1 if vision else 0, prefill=1, decode=1)


@final
class NodeCore:
    """See the module docstring. `node_id` names the node in a cluster (replicas are then named
    `{node_id}/{role}-{n}`); single Trio thread."""

    def __init__(
        self,
        config: NodeConfig,
        log: EventLog,
        *,
        decides: Callable[[], bool] = lambda: True,
        load: Callable[[], LoadTotals] = LoadTotals,
    ) -> None:
        """`decides`: whether this node's controller decides now (in a cluster: while it leads); `load`:
        this node's measured load (the pull estimate's speeds, `engine.prefix_pull`)."""
        self.config = config
        self.log = log
        dtype = config.compute_dtype
        self.host = ModelHost(
            config.model,
            device=config.device,
            dtype=dtype,
            cache_dir=config.model_cache,
            batch_invariant=config.executor.batch_invariant,
        )
        self.served = served_model(config, self.host)  # ConfigError: --max-model-len, --chat-template
        self.counts = config.replicas or default_counts(self.host)
        self.clustered = config.cluster.cluster is not None
        self.node_id = config.cluster.node_id or f"node-{os.getpid()}"
        # Who may open this node's links and its control socket (docs/security.md)
        self.credentials, self.control_token = node_credentials(config)  # CredentialError: a bad file
        self.settings = replica_settings(
            config, self.served.context, self.credentials.admission(self.node_id, tls=config.transfer.tls)
        )
        self.fabric = Fabric(config.transport, clustered=self.clustered, host=config.cluster.cluster_host)
        self.faults = FaultHooks(config.faults)
        self.changes = Changes()
        self.directory = ReplicaDirectory()
        self.router = Router(
            self.directory,
            log,
            settings=self.settings,
            max_queue=config.scheduler.max_queue,
            queue_wait=config.scheduler.queue_wait,
            route_weight=config.prefix.route_weight if config.prefix.cache == "on" else 0.0,
            prefix_keys=self._prefix_keys,
            pull=self._pull_estimate(dtype, load) if config.prefix.cache == "on" else None,
        )
        self.changes.watch(self.router.dispatch)
        # Requests a replica gives back (its role changed before they started).
        self.returned: Subscribers[ServingRequest] = Subscribers()
        self.returned.subscribe(self.router.returned)
        self.controller = Controller(self.directory, self.fabric, log, config.controller, decides=decides)
        self.control_address: str | None = None  # set once the control socket listens
        self.http_url: str | None = None  # set once the HTTP API listens
        self.drain_deadline = config.shutdown.drain_deadline
        self.started = time.monotonic()
        self._shutdown = trio.Event()
        self._shutdown_reason: tuple[str, str] = ("shutdown_op", "")
        self._replica_nursery: trio.Nursery | None = None
        self._indices = {role: itertools.count(0) for role in ROLES}
        # Held by a `scale` op while it runs (`engine.scaling`): scales apply one after another.
        self.scale_lock = trio.Lock()

    def _pull_estimate(self, dtype: str, load: Callable[[], LoadTotals]) -> PullEstimate:
        """The router's estimate of whether a pull beats computing (`--prefix-pull`)."""
        model, prefix = self.host.config, self.config.prefix
        element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        emulated = self.config.emulated_speed
        return PullEstimate(
            prefix.pull,
            kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * model.head_dim * element,
            link_gbps=prefix.pull_link_gbps,
            prefill_tokens_per_s=None if emulated is None else emulated.prefill_tokens_per_s,
            totals=load,
        )

    def _prefix_keys(self, request: ServingRequest) -> list[bytes]:
        """`request`'s prompt block keys for KV-aware routing (none before the model is loaded)."""
        model = self.host.loaded
        return [] if model is None else routing_keys(request, model, self.config.kv.block_size)

    def identity(self) -> ClusterIdentity:
        """What every node of this node's cluster must serve alike."""
        return ClusterIdentity(
            model=self.host.name,
            dtype=str(self.host.dtype).removeprefix("torch."),
            kv_block_size=self.config.kv.block_size,
            embedding_block_size=self.config.embedding.block_size,
        )

    @property
    def shutting_down(self) -> bool:
        return self._shutdown.is_set()

    def request_shutdown(self, detail: str, reason: str = "shutdown_op") -> None:
        if not self._shutdown.is_set():
            self._shutdown_reason = (reason, detail)
            self._shutdown.set()

    async def wait_shutdown(self) -> None:
        await self._shutdown.wait()

    # ------------------------------------------------------------------ replicas
    async def add_replica(self, role: Role) -> Replica:
        """Create replica `{role}-{n}` (Inactive), start its supervised task, and only then make it one of
        the node's replicas. Raises `ReplicaStartFailed` (the replica never listed) when it cannot start.

        Listed while it started, an `Inactive` replica could be commanded by others (a `transition`, or
        another `scale` starting `Inactive` replicas) before the caller's own command reached it, which
        was then refused. Listed after, with no checkpoint before the caller posts its command, the
        caller's command is the first the replica handles."""
        assert self._replica_nursery is not None, "replicas start inside `start_replicas`' nursery"
        prefix = f"{self.node_id}/" if self.clustered else ""
        index = next(self._indices[role])
        while f"{prefix}{role}-{index}" in self.directory:
            index = next(self._indices[role])
        replica = Replica(
            f"{prefix}{role}-{index}",
            role,
            settings=self.settings,
            host=self.host,
            fabric=self.fabric,
            log=self.log,
            requests=self.router.requests,
            directory=self.directory,
            returned=self.returned,
            changes=self.changes,
            faults=self.faults,
        )
        await self._replica_nursery.start(supervise, replica)
        self.directory.add(replica)
        return replica

    def kv_sizing_applies(self) -> bool:
        """Whether `--gpu-memory-utilization` sizes the KV pools (a cuda device, no `--kv-pool-blocks`,
        a prefill or decode replica to start); logs, at info, what sizes them when it does not."""
        config, counts = self.config, self.counts
        default = math.ceil(self.served.context / config.kv.block_size)
        if config.device == "cpu":
            _log.info(
                "kv.pool_size",
                detail="--gpu-memory-utilization does not apply on cpu; "
                + (
                    f"--kv-pool-blocks sizes the KV pools ({config.kv.pool_blocks} blocks per replica)"
                    if config.kv.pool_blocks is not None
                    else f"each KV pool holds one maximum-context request ({default} blocks; "
                    "--kv-pool-blocks sets it)"
                ),
            )
            return False
        if config.kv.pool_blocks is not None:
            _log.info(
                "kv.pool_size",
                detail=f"--kv-pool-blocks {config.kv.pool_blocks} sizes the KV pools; "
                "--gpu-memory-utilization is not used",
            )
            return False
        if counts.prefill + counts.decode == 0:
            _log.info(
                "kv.pool_size",
                detail="no prefill or decode replica to start: replicas added later get one "
                f"maximum-context request ({default} blocks; --kv-pool-blocks sets it)",
            )
            return False
        return True

    def size_kv_pools(self, memory: tuple[int, int]) -> None:
        """Size the KV pools from the device's `(free, total)` bytes, read with the weights loaded
        (`engine.kv_sizing`). Raises `KvBudgetError`."""
        self.settings, sized = device_kv_settings(
            self.settings, self.config, self.host.config, self.counts, self.served.context, memory
        )
        _log.info(
            "kv.pool_size",
            detail=f"--gpu-memory-utilization {self.config.gpu_memory_utilization} sizes the KV pools",
            kv_pool_blocks=sized.blocks,
            budget_bytes=sized.budget,
            in_use_bytes=sized.in_use,
            total_bytes=sized.total,
        )

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

    async def start_replicas(self, nursery: trio.Nursery) -> None:
        """Start the configured replicas in `nursery` and command each into `Loading*` (requests sent
        meanwhile wait in the router's queue). Raises `ReplicaStartFailed` when one cannot start, the
        loader's `ModelLoadError` or `KvBudgetError` when the KV pools are sized (`kv_sizing_applies`).
        Cancellation: the sizing hold on the resident copy is released on the way out."""
        self._replica_nursery = nursery
        # The kernels' start-up check compiles them (seconds on a GPU): once, in a worker thread, before
        # any replica builds an executor on the event loop (they then find its cached verdict).
        await trio.to_thread.run_sync(self._check_kernels)
        sizing = self.kv_sizing_applies()
        if sizing:
            # The resident copy held while the pools are sized and allocated; the replicas then load
            # it again from the node's host copy (no file is read twice).
            await self.host.acquire(KV_SIZING_HOLDER)
        try:
            if sizing:
                self.size_kv_pools(torch.cuda.mem_get_info(torch.device(self.config.device)))
            for role in ROLES:
                for _ in range(getattr(self.counts, role)):
                    await self.add_replica(role)
        finally:
            if sizing:
                self.host.release(KV_SIZING_HOLDER)
        for replica in self.directory.local():
            replica.tell(
                Transition(command_id=new_command_id(), to=LOADING_STATE[replica.role].value, origin="node")
            )

    # ------------------------------------------------------------------ shutdown
    async def drain(self, server: ControlServer) -> None:
        """Stop admitting, let in-flight requests finish within the drain deadline, cancel the rest."""
        reason, detail = self._shutdown_reason
        requests = self.router.requests
        self.log.emit(NodeStopping(reason=reason, detail=detail, in_flight=len(requests)))  # type: ignore[arg-type]
        self.router.accepting = False
        server.stop_accepting()
        with trio.move_on_after(self.drain_deadline):
            await self.router.wait_idle()
            # The handlers relay the final updates: closing before they did lost those results.
            await server.wait_requests_done()
        for request in list(requests.values()):
            request.note_cancel_reason("shutdown")
            self.router.cancel(request.request_id)
        with trio.move_on_after(SETTLE_SECONDS):
            await self.router.wait_idle()
            await server.wait_requests_done()
        server.close()
        await server.wait_closed()  # the final replies are sent (bounded by the write timeout)

    def release_replicas(self) -> None:
        """After the node stopped: let the stopped replicas go, and with them their pools' memory."""
        assert self._shutdown.is_set(), "release_replicas before the node stopped"
        self.directory.clear()

    def finish(self) -> int:
        """Check every pool for leaked blocks; returns the exit code (0, or 1 when blocks leaked)."""
        leaked = 0
        for replica in self.directory.local():
            for pool, owners in replica.leaks().items():
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
