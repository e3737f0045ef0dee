"""A replica's own copy of the weights, from a source, piece by piece (architecture §8). The public entry point:

    outcome = await copy_weights(target, "auto", on_model=..., on_piece=...)   # raises WeightCopyFailed

`copy_weights(target, source, *, on_model, on_piece, emulated=None, memory_probe=available_memory)
-> CopyOutcome` loads the node's model (`target.host`) into storage of the replica's own, in
checkpoint order (`replicas.loading.pieces`): embeddings, layers 0 … L−1, final norm, head (untied only).
`source` is one of:

- `peer` (blitz): from another running replica that holds a fully loaded model, over the replicas'
  transport links (`replicas.loading.peer_receive` / `peer_send`; counted on the fabric as `weights`);
- `host`: from the node's host-memory copy (`replicas.loading.host_copy`), once the node has one;
- `disk`: from the checkpoint files (`replicas.loading.disk`);
- `auto`: peer when another replica holds the whole model, then host when the host copy exists, then disk.
  When a source fails mid-copy (a peer stopping, a link dropping, a read error) `auto` goes on with the
  next source from the piece it reached; an explicit source fails the copy.

Before anything moves, a copy that would not fit in the device's available memory is refused
(`replicas.loading.memory`; `memory_probe` is injectable). `on_model(model)` is called once the
embeddings landed: the `Model` is usable from then on for its leading loaded layers (`Model.loaded_layers`;
ZigZag runs them); `on_piece(PieceLoaded)` after every piece. Layers that come as checkpoint tensors
(peer, disk) are installed in the plain layout: the caller packs them once the copy is done
(`replicas.model.layers.packed_layer`), off the copy's path. Both are called in the caller's Trio
thread. With `emulated` (the node's `--emulated-speed`, `replicas.emulation`) each piece is padded with a
sleep to `bytes / (X·1e9)` seconds from its start, X being the emulated speed of the source it came from
(`peer_gb_per_s`, `host_gb_per_s`, `disk_gb_per_s`, else `weights_gb_per_s`); the real copy still
happens. The `hold_weights` fault hook (`messages.faults.HoldWeights`) holds a copy before a chosen layer. Events: `WeightsCopyStarted`,
one `WeightsProgress` per piece, `WeightsCopyFinished` (`messages.log.scaling`).

Raises `WeightCopyFailed` with a message a person can act on: the source is unavailable or failed, or
the copy does not fit. Cancellation: the piece in flight is abandoned (a transfer aborts; a worker thread
finishes its piece first — threads are never abandoned), `WeightsCopyFinished(status="aborted")` is
logged and `Cancelled` propagates; nothing half-loaded is handed over beyond the model given to
`on_model`, whose missing layers are simply absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, assert_never, final

import torch
import trio

from messages.control import SourceChoice
from messages.log.events import WeightsProgress
from messages.log.scaling import (
    WeightsCopyFinished,
    WeightsCopyStarted,
    WeightsFallback,
    WeightsSourceName,
)
from messages.weights import WeightPiece
from replicas.emulation import EmulatedSpeed
from replicas.fabric import Fabric, UnknownEndpoint
from replicas.faults import FaultHooks
from replicas.loading.builder import ModelBuilder
from replicas.loading.memory import MemoryProbe, available_memory, refusal
from replicas.loading.peer_receive import PeerSource
from replicas.loading.pieces import model_bytes, piece_bytes
from replicas.loading.progress import CopyOutcome, PieceLoaded
from replicas.loading.sources import DiskSource, HostSource, Source, SourceFailed
from replicas.loading.staging import weights_endpoint_name
from replicas.model.llama import Model
from replicas.ports import Directory, EventSink, NodeSignal, PeerReplica
from replicas.weights import ModelHost
from transport.endpoint import TransferEndpoint
from transport.protocol.scope import open_task_scope

ORDER: tuple[WeightsSourceName, ...] = ("peer", "host", "disk")


@final
class WeightCopyFailed(Exception):
    """A replica's own weight copy failed or was refused; the message says which source, at which piece,
    why, and what to try instead."""


@final
@dataclass(frozen=True, slots=True)
class CopyTarget:
    """The replica a copy lands in: its name and log, its weights `endpoint`, the node's model `host`,
    fabric and fault hooks, the replicas it may copy from (`directory`), how long a peer may take to
    start a part (`timeout`; in a chain, to land the next piece), and the node's change signal (a
    replica in a chain waits on it for the piece before it to land)."""

    name: str
    log: EventSink
    endpoint: TransferEndpoint
    host: ModelHost
    fabric: Fabric
    faults: FaultHooks
    directory: Directory
    timeout: float
    changes: NodeSignal


@final
@dataclass(frozen=True, slots=True)
class Candidate:
    """One source a copy may read from: `name`, `what` it is, why `auto` would pick it (`why`), and the
    `peer` replica for a peer source."""

    name: WeightsSourceName
    what: str
    why: str
    peer: PeerReplica | None = None
    chained: bool = False  # the peer is loading too: each piece is read once it has landed there


def _host_of(address: str) -> str:
    """The host of a transfer address (`tcp://10.0.0.2:4567`, `ucx://…`); '' when it has none."""
    rest = address.partition("://")[2]
    return rest.rpartition(":")[0].strip("[]")


Proximity = Literal["node", "host", "network"]


@final
@dataclass(frozen=True, slots=True)
class FoundPeer:
    """A replica a copy may read from: how near it is (`proximity`), and where, for people (`where`)."""

    replica: PeerReplica
    proximity: Proximity
    where: str


def peers(directory: Directory, fabric: Fabric, name: str) -> list[FoundPeer]:
    """The replicas holding a fully loaded model that replica `name` may copy from, fastest first: this
    node's (by name), then other nodes' on the same host (the same `--cluster-host` address), then other
    nodes' elsewhere (by name)."""
    local = sorted(
        (r for r in directory.local() if r.name != name and r.snapshot().serves_weights), key=lambda r: r.name
    )
    found = [FoundPeer(r, "node", "this node") for r in local]
    same: list[FoundPeer] = []
    elsewhere: list[FoundPeer] = []
    for remote in sorted(directory.remote(), key=lambda r: r.name):
        if remote.name == name or not remote.snapshot().serves_weights:
            continue
        try:
            host = _host_of(fabric.address(weights_endpoint_name(remote.name)))
        except UnknownEndpoint:
            continue  # its node has not reported its weights endpoint: not reachable yet
        node = remote.name.partition("/")[0]
        if host and host == fabric.host:
            same.append(FoundPeer(remote, "host", f"node {node} on this host ({host})"))
        else:
            elsewhere.append(FoundPeer(remote, "network", f"node {node} at {host or 'an unknown host'}"))
    return [*found, *same, *elsewhere]


def choose_peer(directory: Directory, fabric: Fabric, name: str) -> PeerReplica | None:
    """The peer a copy into replica `name` reads from first (`peers`), or None."""
    found = peers(directory, fabric, name)
    return found[0].replica if found else None


def plan_sources(requested: SourceChoice, found: list[FoundPeer], host_copy: bool) -> list[Candidate]:
    """The sources a copy tries, in order. `auto`: every peer (`peers`' order: within this node's
    memory first, then over the links of this host, then over the network), then this node's host copy,
    then disk — the fastest source known first; an explicit source: that one alone (a peer: the first)."""
    candidates: list[Candidate] = []
    for peer in found:
        what = f"replica {peer.replica.name} ({peer.where})"
        match peer.proximity:
            case "node":
                why = f"{what} holds the whole model: a copy within the node's memory"
            case "host":
                why = f"{what} holds the whole model and no replica of this node does"
            case "network":
                why = f"{what} holds the whole model and no replica of this node or this host does"
            case _:
                assert_never(peer.proximity)
        candidates.append(Candidate("peer", what, why, peer.replica))
    nobody = "no replica in the cluster holds the whole model"
    if host_copy:
        candidates.append(
            Candidate("host", "the node's host-memory copy", f"{nobody}; the node's host copy does")
        )
    candidates.append(
        Candidate(
            "disk",
            "the checkpoint's files",
            f"{nobody}{'' if host_copy else ' and this node has no host-memory copy'}: the checkpoint's files",
        )
    )
    if requested == "auto":
        return candidates
    chosen = next((c for c in candidates if c.name == requested), None)
    return (
        []
        if chosen is None
        else [Candidate(chosen.name, chosen.what, f"asked for {chosen.what}", chosen.peer)]
    )


async def copy_weights(
    replica: CopyTarget,
    source: SourceChoice,
    *,
    on_model: Callable[[Model], None],
    on_piece: Callable[[PieceLoaded], None],
    emulated: EmulatedSpeed | None = None,
    memory_probe: MemoryProbe = available_memory,
    upstream: str | None = None,
) -> CopyOutcome:
    """See the module docstring."""
    copy = _Copy(replica, source, replica.host.next_copy(), emulated, on_model, on_piece, upstream)
    peers_in_order = [c.peer.name for c in copy.order if c.peer is not None]
    replica.log.emit(
        WeightsCopyStarted(
            copy=copy.number,
            requested=source,
            sources=[c.name for c in copy.order],
            peer=peers_in_order[0] if peers_in_order else None,
            peers=peers_in_order,
            reason=copy.order[0].why if copy.order else "no source can serve",
            total_bytes=copy.total,
            total_layers=copy.config.num_layers,
            device=str(copy.device),
        )
    )
    try:
        return await copy.run(memory_probe)
    except WeightCopyFailed as exc:
        copy.finished("failed", str(exc))
        raise
    except BaseException as exc:
        stopped = isinstance(exc, trio.Cancelled)
        copy.finished("aborted", "the replica stopped" if stopped else f"{type(exc).__name__}: {exc}")
        raise


@final
class _Copy:
    """One copy's state: the sources to try, the builder, what happened so far."""

    def __init__(
        self,
        replica: CopyTarget,
        requested: SourceChoice,
        number: int,
        emulated: EmulatedSpeed | None,
        on_model: Callable[[Model], None],
        on_piece: Callable[[PieceLoaded], None],
        upstream: str | None = None,
    ) -> None:
        host = replica.host
        self.replica, self.requested, self.number = replica, requested, number
        self.host, self.config, self.model_name = host, host.config, host.name
        self.device = torch.device(host.device)
        self.emulated, self.on_model, self.on_piece = emulated, on_model, on_piece
        self.total = model_bytes(self.config)
        found = peers(replica.directory, replica.fabric, replica.name)
        self.order = plan_sources(requested, found, host.host_copy is not None)
        before = None if upstream is None else replica.directory.get(upstream)
        if before is not None and requested in ("auto", "peer") and found:
            # A multicast chain: the replica before this one in the same scale forwards each piece as it
            # lands; the sources after it serve from the piece reached should it fail.
            first = found[0].replica
            self.order = [
                Candidate(
                    "peer",
                    f"replica {before.name} (this node, loading)",
                    f"a multicast chain: replica {before.name} loads the same weights from {first.name} "
                    "just before this one and forwards each piece as it lands",
                    before,
                    chained=True,
                ),
                *plan_sources(requested, found, host.host_copy is not None),
            ]
        self.peer: PeerReplica | None = None  # the peer read from last
        self.builder = ModelBuilder(host.frame(), pack_later=True)
        self.fallbacks: list[WeightsFallback] = []
        self.used: list[WeightsSourceName] = []
        self.loaded_bytes = 0
        self.held = False
        self.head_made: trio.Event | None = None  # set once the tied head made ahead is ready
        self.started = trio.current_time()

    async def run(self, memory_probe: MemoryProbe) -> CopyOutcome:
        why = refusal(self.total, self.device, memory_probe)
        if why is not None:
            raise WeightCopyFailed(
                f"{self.replica.name}: refused to copy the weights of {self.model_name}: {why}"
            )
        if not self.order:
            raise WeightCopyFailed(self._unavailable())
        for candidate in self.order:
            source = self._open(candidate)
            try:
                if await self._pieces_from(source):
                    break
            finally:
                with trio.CancelScope(shield=True):
                    await source.aclose()
        if not self.builder.done:
            tried = "; ".join(f"{f.weights_source} at {f.piece}: {f.reason}" for f in self.fallbacks)
            raise WeightCopyFailed(
                f"{self.replica.name}: every source failed copying the weights of {self.model_name} ({tried})"
            )
        assert self.builder.model is not None
        self.finished("success", None)
        return CopyOutcome(
            model=self.builder.model,
            source=self.used[-1],
            sources=tuple(dict.fromkeys(self.used)),
            fallbacks=tuple(self.fallbacks),
            peer=self.peer.name if self.peer is not None and "peer" in self.used else None,
            bytes=self.loaded_bytes,
            seconds=trio.current_time() - self.started,
        )

    def _open(self, candidate: Candidate) -> Source:
        name = candidate.name
        if name == "peer":
            assert candidate.peer is not None
            self.peer = candidate.peer
            target = self.replica
            return PeerSource(
                target.name,
                candidate.peer,
                changes=target.changes if candidate.chained else None,
                endpoint=target.endpoint,
                fabric=target.fabric,
                config=self.config,
                device=self.device,
                model_name=self.model_name,
                timeout=target.timeout,
            )
        if name == "host":
            host_copy = self.host.host_copy
            assert host_copy is not None
            return HostSource(host_copy, self.device)
        return DiskSource(self.host.checkpoint, self.config, self.device, fill=self.host.host_copy_to_fill())

    async def _pieces_from(self, source: Source) -> bool:
        """Load pieces from `source` until the model is complete (True) or it fails under `auto` (False).
        A tied head the model packs is made in a worker thread while the layers move (`head_ahead`),
        and waited for before the norm piece is added."""
        async with open_task_scope() as nursery:  # a failure leaves as itself, not in a group
            return await self._pieces_into(source, nursery)

    async def _pieces_into(self, source: Source, nursery: trio.Nursery) -> bool:
        while (piece := self.builder.next_piece) is not None:
            await self._maybe_hold(piece)
            if piece.kind == "norm" and self.head_made is not None:
                await self.head_made.wait()
            started = trio.current_time()
            try:
                tensors = await source.fetch(piece)
            except SourceFailed as exc:
                if self.requested != "auto":
                    raise WeightCopyFailed(self._failed(exc)) from exc
                reason = (
                    exc.reason
                    if self.peer is None or source.name != "peer"
                    else f"{self.peer.name}: {exc.reason}"
                )
                self.fallbacks.append(
                    WeightsFallback(weights_source=source.name, piece=piece.label, reason=reason)
                )
                return False
            model = await trio.to_thread.run_sync(self.builder.add, piece, tensors)
            del tensors
            if piece.kind == "embeddings" and self.head_made is None:
                self.head_made = trio.Event()
                nursery.start_soon(self._head_ahead, self.head_made)
            nbytes = piece_bytes(self.config, piece)
            pad = None if self.emulated is None else self.emulated.copy_seconds(nbytes, source.name)
            if pad is not None:
                await trio.sleep_until(started + pad)
            self._landed(piece, source.name, nbytes, trio.current_time() - started, model)
        return True

    async def _head_ahead(self, made: trio.Event) -> None:
        """`ModelBuilder.head_ahead` in a worker thread (it runs to its end: threads are never abandoned)."""
        try:
            await trio.to_thread.run_sync(self.builder.head_ahead)
        finally:
            made.set()

    def _landed(
        self, piece: WeightPiece, source: WeightsSourceName, nbytes: int, seconds: float, model: Model
    ) -> None:
        self.loaded_bytes += nbytes
        if not self.used or self.used[-1] != source:
            self.used.append(source)
        landed = PieceLoaded(
            piece=piece,
            source=source,
            bytes=nbytes,
            seconds=seconds,
            loaded_layers=model.loaded_layers,
            total_layers=self.config.num_layers,
            bytes_loaded=model.parameter_bytes(),
        )
        self.replica.log.emit(
            WeightsProgress(
                layers_loaded=landed.loaded_layers,
                layers_total=landed.total_layers,
                seconds=trio.current_time() - self.started,
                piece=piece.kind,
                layer=piece.layer,
                bytes=nbytes,
                piece_seconds=seconds,
                weights_source=source,
                bytes_loaded=landed.bytes_loaded,
            )
        )
        if piece.kind == "embeddings":
            self.on_model(model)
        self.on_piece(landed)

    async def _maybe_hold(self, piece: WeightPiece) -> None:
        """The `hold_weights` fault hook: once per copy, before the layer it names."""
        layers = self.config.num_layers
        position = piece.layer if piece.kind == "layer" else layers if piece.kind == "norm" else None
        if self.held or position is None:
            return
        target = self.replica
        self.held = await target.faults.before_layer(target.name, self.number, position, layers, target.log)

    def _unavailable(self) -> str:
        name, model = self.replica.name, self.model_name
        if self.requested == "peer":
            return (
                f"{name}: no other running replica, of this node or another, holds a fully loaded copy of "
                f"{model} to copy from (source peer); use source auto, host or disk"
            )
        return (
            f"{name}: the node holds no host-memory copy of {model} yet (it is filled when the node first "
            "loads the model from disk; source host); use source auto or disk"
        )

    def _failed(self, exc: SourceFailed) -> str:
        what = f"{self.replica.name}: copying the weights of {self.model_name} from {exc.source}"
        if exc.source == "peer" and self.peer is not None:
            what += f" replica {self.peer.name}"
            node = self.peer.name.partition("/")[0] if "/" in self.peer.name else None
            if node is not None and self.peer not in self.replica.directory.local():
                what += f" (node {node})"
        others = ", ".join(name for name in ("auto", *ORDER) if name != exc.source)
        return f"{what} failed at {exc.piece.label}: {exc.reason} (source {others} may serve instead)"

    def finished(self, status: Literal["success", "failed", "aborted"], reason: str | None) -> None:
        self.replica.log.emit(
            WeightsCopyFinished(
                copy=self.number,
                status=status,
                weights_source=self.used[-1] if self.used else None,
                fallbacks=list(self.fallbacks),
                reason=reason,
                bytes=self.loaded_bytes,
                seconds=trio.current_time() - self.started,
            )
        )
