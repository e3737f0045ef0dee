"""This node as a member of a cluster: membership, peer links, the other nodes' replicas, and the
requests that cross nodes (docs/cluster.md).

The member owns the books (`engine.cluster.books`): the requests that cross nodes — which node holds
each of this node's requests, the mirrors it holds of others' — and the incarnation each other node is
known under; its parts (`engine.cluster.frames`, `engine.cluster.commands`) change them through the
books' methods only.

Incarnations: this member knows each other node under one lease (from its etcd record). When a node
leaves — or comes back under a new lease (restarted, or cut off long enough to lose its lease) —
everything this member shared with the old incarnation ends (`_node_gone`): its replicas' reports, its
peer connection and transfer links, the origin requests it held (`replica_failed`) and the mirrors it
was the origin of (`RequestBooks.end_shared`); the new incarnation is then known from scratch, from its
record and its next report. Frames count only under the sender's known lease (`engine.cluster.frames`).
When this node's own lease ends, the others have ended what they shared with it: it ends the same
(`_lease_lost`), takes a new lease at once and keeps serving with its own replicas meanwhile — new
requests are admitted and wait for cross-node work until the new lease is registered (docs/cluster.md,
"Failures").

Cancellation: `run` owns the peer links, the membership tasks and the report loop; leaving the cluster
(`Membership.leave`) runs shielded when it ends.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar, final

import structlog
import trio

from engine.cluster.books.incarnations import Incarnations
from engine.cluster.books.requests import RequestBooks
from engine.cluster.commands import run_command, serve_command
from engine.cluster.frames import Frames
from engine.cluster.membership import Membership
from engine.cluster.ops import ClusterOps, Handle
from engine.cluster.peers import PeerLinks
from engine.cluster.remote import RemoteReplica
from engine.cluster.reports import build_report, node_record, prefix_versions
from engine.cluster.requests import snapshot
from engine.control.errors import RequestFailed
from engine.core import NodeCore
from messages.cluster import ClientOp, LoadTotals, NodeRecord, PeerFrame, Report, RunCommand, Submit
from messages.commands import ReplicaCommand
from messages.control import ControlRequest
from messages.control_replies import ClusterTotals, ClusterView, MetricsResult, ReplicaStatus
from replicas.request import ServingRequest
from replicas.states import SERVING_ROLE, SETTLED, Role
from transport.auth.credentials import NO_CREDENTIALS, Credentials

R = TypeVar("R")

_log = structlog.get_logger("engine.cluster")
REPORT_PERIOD: Final = 0.05
REPORT_HEARTBEAT: Final = 1.0


@final
class ClusterMember:
    """See the module docstring: node `core` as a member (`membership`) of its cluster. `handle` serves
    the control ops other nodes forward here, `load` gives the node's load counters for its reports.
    It gives the node the other nodes' replicas (`ReplicaDirectory.serve_remote`), takes back the
    mirrors a replica gives back (`Router.held_returned`) and tells the router which requests to refuse
    while etcd is out of reach (`Router.refusal`); to the node's control handler and planner it is their
    `Cluster`."""

    def __init__(
        self,
        core: NodeCore,
        membership: Membership,
        *,
        handle: Handle,
        load: Callable[[], LoadTotals],
        credentials: Credentials = NO_CREDENTIALS,
    ) -> None:
        self.core = core
        self.router = core.router
        self.directory = core.directory
        self.fabric = core.fabric
        self.load = load
        self.node_id = membership.node_id
        self.membership = membership
        membership.on_change = self._members_changed
        self.incarnations = Incarnations()
        self.peers = PeerLinks(
            self.node_id,
            lambda: membership.lease,
            self._on_frame,
            credentials,
            known_lease=lambda node: self.incarnations.lease_of(node) or 0,
        )
        self.books = RequestBooks(
            self.node_id,
            router=self.router,
            post=self.peers,
            replicas=self.directory,
            others=self.other_nodes,
        )
        self.frames = Frames(self, self.books, self.incarnations)
        self.ops = ClusterOps(self, handle)
        self.remote: dict[str, RemoteReplica] = {}
        self.reported: dict[str, Report] = {}
        self._nursery: trio.Nursery | None = None
        # Replica name → the prefix-cache version the last broadcast brought the others to.
        self._prefix_versions: dict[str, int] = {}
        self.pid = os.getpid()
        core.directory.serve_remote(self.peer_replicas)
        core.router.held_returned.subscribe(self.books.give_back)
        core.router.refusal = self._refusal

    # ------------------------------------------------------------------ life
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for peers, join, and serve the cluster until cancelled; raises `JoinRefused` before
        `task_status.started` when this node cannot join."""
        config = self.core.config.cluster
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            peer_address = await nursery.start(self.peers.run, config.cluster_host)
            await self.membership.check_identity(self.core.identity())
            await self.membership.join(self._record(peer_address))
            try:
                nursery.start_soon(self.membership.run)
                nursery.start_soon(self._report_loop)
                nursery.start_soon(self._rejoin_loop)
                task_status.started()
                await trio.sleep_forever()
            finally:
                await self.membership.leave()
                nursery.cancel_scope.cancel()

    @property
    def lease(self) -> int:
        """This node's lease now (the incarnation other nodes know it as)."""
        return self.membership.lease

    @property
    def reachable(self) -> bool:
        """Cross-node work may start: etcd answers and this node holds its lease."""
        return self.membership.state == "ok"

    def _refusal(self, request: ServingRequest) -> RequestFailed | None:
        """While etcd cannot be reached (`degraded`) this node starts no cross-node work. For up to the
        lease TTL that is a blip (an etcd restarting): requests are admitted and wait. Past it, for how
        long is unknown: a request this node's own replicas cannot serve from start to end is refused at
        once, saying when to retry, rather than queued until `queue_wait` runs out. (While `rejoining`
        — etcd answers, a new lease is a round trip away — requests are admitted and wait for it.)"""
        membership = self.membership
        if membership.state != "degraded" or self._serves_alone(request):
            return None
        cut_off = trio.current_time() - membership.since
        if cut_off < membership.ttl:
            return None
        return RequestFailed(
            "overloaded",
            f"node {self.node_id} has not reached the cluster's etcd for {cut_off:.0f} s and its own "
            f"replicas cannot serve this request alone; retry in about {membership.ttl} s (the lease TTL), "
            "or send it to another node",
        )

    def _serves_alone(self, request: ServingRequest) -> bool:
        """This node has a replica serving plainly (`SETTLED`) in each role `request` needs."""
        states = (replica.snapshot().state for replica in self.directory.local())
        serving = {SERVING_ROLE[state] for state in states if state in SETTLED}
        needs: set[Role] = {"prefill", "decode", *(("encode",) if request.needs_embeddings else ())}
        return needs <= serving

    def peer_replicas(self) -> list[RemoteReplica]:
        return list(self.remote.values()) if self.reachable else []

    def find_remote(self, name: str) -> RemoteReplica | None:
        """Another node's replica: by its cluster name, or by a bare `{role}-{n}` only one node has."""
        if name in self.remote:
            return self.remote[name]
        matches = [r for r in self.remote.values() if r.name.rpartition("/")[2] == name]
        return matches[0] if len(matches) == 1 else None

    @property
    def replica_slots(self) -> int:
        """Replica slots still free on this node (`--replica-slots` minus its replicas)."""
        return self.core.config.cluster.replica_slots - len(self.core.directory)

    # ------------------------------------------------------------------ the node's `Cluster`
    @property
    def is_leader(self) -> bool:
        return self.membership.is_leader

    def locate(self, name: str) -> tuple[str, str] | None:
        remote = self.find_remote(name)
        return None if remote is None else (remote.name, remote.node)

    def remote_statuses(self) -> list[ReplicaStatus]:
        return self.ops.statuses()

    def reports(self) -> Mapping[str, Report]:
        return self.reported

    def place(self, wanted: str | None) -> str:
        return self.ops.place(wanted)

    async def forward(self, node: str, request: ControlRequest, result_type: type[R]) -> R:
        return await self.ops.forward(node, request, result_type)

    async def cancel_elsewhere(self, request: ControlRequest, result_type: type[R]) -> R | None:
        return await self.ops.cancel_elsewhere(request, result_type)

    async def shutdown_others(self, request: ControlRequest, result_type: type[R]) -> list[str]:
        return await self.ops.shutdown_others(request, result_type)

    async def totals(self, mine: MetricsResult) -> ClusterTotals:
        return await self.ops.totals(mine)

    def view(self) -> ClusterView:
        membership = self.membership
        return ClusterView(
            node=self.node_id,
            state=membership.state,
            leader=membership.leader,
            nodes=sorted(membership.members),
            lease=membership.lease,
        )

    def other_nodes(self) -> list[str]:
        return [n for n in self.membership.members if n != self.node_id]

    # ------------------------------------------------------------------ reports
    async def _report_loop(self) -> None:
        """Tell the others this node's report when it changed, at most every `REPORT_PERIOD`, and at
        least every `REPORT_HEARTBEAT` (their liveness and load figures). While it holds no request it
        sleeps until a node-wide change (a replica's state, lock or room) or the heartbeat is due;
        while it serves, it looks every period (queues and load counters move with every step). Frames
        held for an incarnation not known yet expire here too (at least every heartbeat)."""
        core = self.core
        last: Report | None = None
        sent_at = checked_at = -math.inf
        seen = core.changes.count
        registered: tuple[object, ...] = ()
        while True:
            await trio.sleep_until(checked_at + REPORT_PERIOD)
            if not core.router.requests and core.changes.count == seen:
                with trio.move_on_at(sent_at + REPORT_HEARTBEAT):
                    await core.changes.wait()
            seen, checked_at = core.changes.count, trio.current_time()
            self.frames.expire()
            report = self._report()
            heartbeat = checked_at - sent_at >= REPORT_HEARTBEAT
            if report != last or heartbeat:
                if heartbeat:  # prefix caches as whole views: a peer that missed a delta catches up
                    report = self._report(whole=True)
                self.peers.broadcast(self.other_nodes(), report)
                last, sent_at = report, checked_at
                self._prefix_versions = prefix_versions(report)
            # The etcd record holds the replicas and addresses: re-written when they change.
            facts = (sorted(core.directory), core.control_address, core.http_url)
            if facts != registered and self.membership.state == "ok":
                registered = facts
                await self.membership.update(self._record(self.peers.address or ""))

    def _report(self, *, whole: bool = False) -> Report:
        """This node's report; each prefix cache as a delta from what the last broadcast said, or
        (`whole`) as a whole view."""
        since = None if whole else self._prefix_versions
        return build_report(self.core, pid=self.pid, load=self.load(), prefix_since=since)

    def _record(self, peer_address: str) -> NodeRecord:
        return node_record(
            self.core,
            node_id=self.node_id,
            pid=self.pid,
            lease=self.membership.lease,
            peer_address=peer_address,
        )

    def take_report(self, node: str, report: Report) -> None:
        if node not in self.incarnations:
            return  # a node that left (or not yet seen in etcd): its replicas are not ours to use
        self.reported[node] = report
        self.fabric.remote.update(report.endpoints)
        names = set()
        for entry in report.replicas:
            names.add(entry.status.name)
            existing = self.remote.get(entry.status.name)
            if existing is None:
                self.remote[entry.status.name] = RemoteReplica(self, node, entry)
            else:
                existing.update(entry)
        for name in [n for n, r in self.remote.items() if r.node == node and n not in names]:
            del self.remote[name]
        self.core.changes.notify()  # the router dispatches, waits for a decode replica look again

    # ------------------------------------------------------------------ membership
    def _members_changed(self) -> None:
        members = self.membership.members
        for node, record in members.items():
            if node == self.node_id:
                continue
            known = self.incarnations.lease_of(node)
            if known is not None and known != record.lease:
                self._node_gone(node, f"it came back under a new lease {record.lease:x}")
            self.peers.set_address(node, record.peer_address)
            if self.incarnations.know(node, record.lease):
                self.frames.release(node)
                # What this node serves, and where its endpoints listen, to the new incarnation now:
                # its reservations need them (the heartbeat would tell it within a second).
                self.peers.send(node, self._report(whole=True))
        for node in [n for n in self.incarnations.nodes() if n not in members]:
            self._node_gone(node, "its lease ended: it stopped or was cut off")
        self.core.changes.notify()

    def _node_gone(self, node: str, why: str) -> None:
        """End everything shared with `node`'s incarnation (see the module docstring)."""
        lease = self.incarnations.forget(node)
        self.reported.pop(node, None)
        _log.warning("cluster.node_gone", node=node, lease=f"{lease:x}", why=why)
        self.peers.forget(node)
        for name in [n for n, r in self.remote.items() if r.node == node]:
            del self.remote[name]
        self.fabric.forget_remote(f"{node}/", f"node {node} left the cluster ({why})")
        self.books.end_shared(node, f"node {node} left the cluster ({why})")

    async def _rejoin_loop(self) -> None:
        """A lease that expired while etcd answered: end what was shared under it and take a new one
        at once, serving meanwhile (see the module docstring)."""
        while True:
            await self.membership.state_changed.wait()
            if self.membership.state != "rejoining":
                continue
            _log.warning("cluster.lease_lost", node=self.node_id, lease=f"{self.membership.lease:x}")
            self._lease_lost()
            await self.membership.rejoin()
            self.core.changes.notify()

    @property
    def lease_lost(self) -> bool:
        """This node's lease ended and no new one is taken yet: nothing addressed to it is acted on."""
        return self.membership.state == "rejoining"

    def _lease_lost(self) -> None:
        """This node's lease ended: the others ended what they shared with it; so does it — its requests
        and mirrors, and the transfer links to their nodes (a migration or pull under the old lease ends by
        this event, not by its wait running out; links are dialled again under the new lease)."""
        why = f"node {self.node_id} lost its cluster lease (it was cut off from etcd for over the lease TTL)"
        for node in self.incarnations.nodes():
            self.books.end_shared(node, why)
            self.fabric.close_links(f"{node}/", why)

    # ------------------------------------------------------------------ origin side
    def submit(self, replica: RemoteReplica, request: ServingRequest) -> bool:
        if not self.reachable or replica.node not in self.membership.members:
            return False
        submit = Submit(replica=replica.name, request=snapshot(request, self.node_id, images=True))
        if not self.peers.send(replica.node, submit):
            return False  # over the peer frame limit: its images are too large to send (logged)
        replica.submitted_tokens += request.prompt_tokens
        if replica.report.status.role != "encode":
            self.books.held_at(request, replica.node)
        else:
            self.books.track(request)
        return True

    def _on_frame(self, frame: PeerFrame) -> None:
        self.frames.on_frame(frame)

    def serve_command(self, frame: PeerFrame, message: RunCommand) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(serve_command, self, frame, message)

    def serve_op(self, sender: str, message: ClientOp) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self.ops.serve_forwarded, sender, message)

    # ------------------------------------------------------------------ commands
    async def run_command(self, replica: RemoteReplica, command: ReplicaCommand, *, timeout: float) -> Any:
        """`RemoteReplica.ask` (`engine.cluster.commands`)."""
        return await run_command(self, replica, command, timeout=timeout)
