"""Membership in etcd: join under a lease, keep it alive, watch the members, elect one leader.

Keys (under `/zigzag/{cluster_name}/`): `identity` (`ClusterIdentity`, created once by the first node;
a node that serves another model, dtype, block size or protocol is refused at join, naming the
difference), `nodes/{node_id}` (`NodeRecord`, under the node's lease) and `leader` (the leader's node id,
under its lease: created only when absent — etcd's compare-and-create — so one node holds it).

The lease is renewed every TTL/3 by a worker thread with its own HTTP client, so a busy event loop
cannot starve it. States (`state`): `ok`; `degraded` — etcd cannot be reached: the node keeps serving
what it holds, starts no new cross-node work, and a leader makes no decisions; `rejoining` — the lease
expired while etcd answered (the node stalled, or was cut off for longer than the TTL): the owner ends
what it shared with the others under that lease and calls `rejoin` at once, which takes a new lease and
re-writes the record under it (the record names its lease: the others check frames against it).
Leaving `degraded`, or rejoining, re-reads the members: events may have been missed meanwhile (a watch
stream that went silent in a partition, an etcd that restarted).

Cancellation: `run` owns the keepalive, watch and election tasks; the keepalive thread notices within
one renewal period and ends. `leave` (shielded, bounded) deletes the record and revokes the lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, Literal, final

import msgspec
import structlog
import trio

from engine.cluster.etcd import Etcd, EtcdError, EtcdUnavailable, keepalive_blocking
from messages.cluster import ClusterIdentity, NodeRecord

_log = structlog.get_logger("engine.cluster")
RETRY_SECONDS: Final = 0.5
DEGRADED_RETRY_SECONDS: Final = 0.1
LEAVE_SECONDS: Final = 3.0
State = Literal["ok", "degraded", "rejoining"]


@final
class JoinRefused(Exception):
    """This node cannot join: etcd is unreachable or refuses it (its credentials, its permissions), or
    the cluster serves something else."""


def _cannot_join(error: EtcdUnavailable | EtcdError) -> str:
    """The one line a node that cannot reach, or is refused by, etcd stops with."""
    if isinstance(error, EtcdError) and error.call == "auth/authenticate":
        return (
            f"cannot join the cluster: {error}; give the user and password etcd knows "
            "(--etcd-username, $ZIGZAG_ETCD_PASSWORD)"
        )
    return f"cannot join the cluster: {error}"


@final
class Membership:
    """See the module docstring. `on_change()` runs on the Trio thread after members, leader or state
    changed; `members` maps node id to its record (this node included)."""

    def __init__(
        self,
        etcd: Etcd,
        *,
        cluster_name: str,
        node_id: str,
        ttl: int,
        on_change: Callable[[], None],
        blocked: Callable[[float], bool] | None = None,
        token: str | None = None,
    ) -> None:
        self.etcd = etcd
        self.node_id = node_id
        self.ttl = ttl
        self.prefix = f"/zigzag/{cluster_name}/"
        self.on_change = on_change
        self._blocked_since_join = blocked
        self.token = token
        self.lease = 0
        self.members: dict[str, NodeRecord] = {}
        self.leader: str | None = None
        self.state: State = "ok"
        self.since = 0.0  # when `state` began (trio's clock)
        self.state_changed = trio.Event()
        self._record: NodeRecord | None = None
        self._joined_at = 0.0
        self._decoder = msgspec.json.Decoder(NodeRecord)
        self._watch_scope: trio.CancelScope | None = None

    @property
    def is_leader(self) -> bool:
        """True while this node holds the leader key and reaches etcd (a cut-off leader decides nothing)."""
        return self.leader == self.node_id and self.state == "ok"

    def key(self, node_id: str) -> str:
        return f"{self.prefix}nodes/{node_id}"

    # ------------------------------------------------------------------ join and leave
    async def check_identity(self, identity: ClusterIdentity) -> None:
        """Create the cluster's identity, or compare with it; raises `JoinRefused` naming differences."""
        try:
            await self.etcd.version()
            key = self.prefix + "identity"
            if await self.etcd.create(key, msgspec.json.encode(identity)):
                return
            stored = await self.etcd.get(key)
        except (EtcdUnavailable, EtcdError) as exc:
            raise JoinRefused(_cannot_join(exc)) from None
        if stored is None:
            raise JoinRefused(f"cannot join the cluster: its identity at {key} vanished")
        theirs = msgspec.json.decode(stored.value, type=ClusterIdentity)
        diffs = [
            f"{name} {getattr(identity, name)!r} (the cluster serves {getattr(theirs, name)!r})"
            for name in ClusterIdentity.__struct_fields__
            if getattr(identity, name) != getattr(theirs, name)
        ]
        if diffs:
            raise JoinRefused(f"node {self.node_id} cannot join cluster {self.prefix}: " + "; ".join(diffs))

    async def join(self, record: NodeRecord) -> NodeRecord:
        """Take a lease and register `record` under it (its `lease` field set); raises `JoinRefused`
        when another live node already uses this node id."""
        try:
            self.token = await self.etcd.auth_token()
            lease = await self.etcd.grant(self.ttl)
            record = msgspec.structs.replace(record, lease=lease.id)
            if not await self.etcd.create(
                self.key(self.node_id), msgspec.json.encode(record), lease=lease.id
            ):
                await self.etcd.revoke(lease.id)
                raise JoinRefused(f"node id {self.node_id!r} is in use by a live member of {self.prefix}")
        except (EtcdUnavailable, EtcdError) as exc:
            raise JoinRefused(_cannot_join(exc)) from None
        self.lease, self._record = lease.id, record
        self._joined_at = time.monotonic()
        self.members[self.node_id] = record
        return record

    async def update(self, record: NodeRecord) -> None:
        """Re-write this node's record (its replicas changed). A failure only logs: the next one retries."""
        record = msgspec.structs.replace(record, lease=self.lease)
        self._record = record
        try:
            await self.etcd.put(self.key(self.node_id), msgspec.json.encode(record), lease=self.lease)
        except (EtcdUnavailable, EtcdError) as exc:
            _log.warning("cluster.record_update_failed", error=str(exc))

    async def rejoin(self) -> None:
        """After the lease expired: a new lease, the record under it, and a campaign. Retries until it
        works (bounded by the caller's scope)."""
        assert self._record is not None
        while True:
            try:
                lease = await self.etcd.grant(self.ttl)
                # The record names the lease it lives under: the others check a sender's frames
                # against it (`stale_lease`), so it must be the new one, not the one that expired.
                record = msgspec.structs.replace(self._record, lease=lease.id)
                await self.etcd.put(self.key(self.node_id), msgspec.json.encode(record), lease=lease.id)
                break
            except (EtcdUnavailable, EtcdError) as exc:
                _log.warning("cluster.rejoin_failed", error=str(exc))
                await trio.sleep(RETRY_SECONDS)
        self.lease, self._record = lease.id, record
        self.members[self.node_id] = record
        _log.info("cluster.rejoined", node=self.node_id, lease=self.lease)
        self._set_state("ok")
        await self._campaign()

    async def leave(self) -> None:
        """Delete the record and revoke the lease (shielded, at most `LEAVE_SECONDS`); never raises."""
        with trio.CancelScope(shield=True), trio.move_on_after(LEAVE_SECONDS):
            try:
                await self.etcd.delete(self.key(self.node_id))
                await self.etcd.revoke(self.lease)
            except (EtcdUnavailable, EtcdError) as exc:
                _log.warning("cluster.leave_failed", error=str(exc))

    # ------------------------------------------------------------------ running
    async def run(self) -> None:
        """Keep the lease, watch the members and campaign until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keepalive)
            nursery.start_soon(self._watch)

    def _set_state(self, state: State, *, resync: bool = True) -> None:
        if state != self.state:
            previous = self.state
            _log.info("cluster.state", node=self.node_id, state=state, previous=previous)
            self.state = state
            self.since = trio.current_time()
            self.state_changed.set()
            self.state_changed = trio.Event()
            if resync and ((previous != "ok" and state == "ok") or previous == "degraded"):
                # Events may have been missed meanwhile (a watch stream that went silent during a
                # partition, an etcd that restarted): read the members afresh.
                self._resync()
            self.on_change()

    def _resync(self) -> None:
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    async def _keepalive(self) -> None:
        stop = threading.Event()
        token = trio.lowlevel.current_trio_token()
        try:
            await trio.to_thread.run_sync(self._keepalive_thread, stop, token, abandon_on_cancel=True)
        finally:
            stop.set()  # the thread ends within one period

    def _keepalive_thread(self, stop: threading.Event, token: trio.lowlevel.TrioToken) -> None:
        period = max(0.2, self.ttl / 3)
        wait, failures = period, 0
        while not stop.wait(wait):
            lease = self.lease
            if self.state == "rejoining" or self._blocked():
                continue
            try:
                ttl = keepalive_blocking(
                    self.etcd.url, lease, timeout=period, tls=self.etcd.tls, token=self.token
                )
                state: State = "ok" if ttl > 0 else "rejoining"
                wait, failures = period, 0
            except (EtcdUnavailable, EtcdError) as exc:
                if not failures:  # once per outage; the state says the rest
                    _log.warning("cluster.keepalive_failed", node=self.node_id, error=str(exc))
                state, failures = "degraded", failures + 1
                # Cut off: try again at once, so a link that came back is noticed within a try.
                wait = DEGRADED_RETRY_SECONDS
            if stop.is_set():
                return
            try:
                trio.from_thread.run_sync(self._kept, lease, state, trio_token=token)
            except trio.RunFinishedError:
                return

    def _blocked(self) -> bool:
        blocked = self._blocked_since_join
        return blocked is not None and blocked(time.monotonic() - self._joined_at)

    def _kept(self, lease: int, state: State) -> None:
        if lease != self.lease:
            return  # an answer about a lease already replaced
        self._set_state(state)

    async def _watch(self) -> None:
        """Read the members and the leader, then follow changes; re-read after every broken watch."""
        decoder = self._decoder
        while True:
            with trio.CancelScope() as self._watch_scope:
                await self._watch_once(decoder)

    async def _watch_once(self, decoder: msgspec.json.Decoder[NodeRecord]) -> None:
        """One read of the members and a watch from there, until it breaks (or `_resync` cancels it)."""
        try:
            kvs, revision = await self.etcd.get_prefix(self.prefix)
            members = {}
            leader = None
            for kv in kvs:
                if kv.key.startswith(self.prefix + "nodes/"):
                    record = decoder.decode(kv.value)
                    members[record.node_id] = record
                elif kv.key == self.prefix + "leader":
                    leader = kv.value.decode()
            self.members, self.leader = members, leader
            if self.state == "degraded":
                self._set_state("ok", resync=False)  # read just now
            self.on_change()
            if leader is None:
                await self._campaign()
            async for event in self.etcd.watch_prefix(self.prefix, start_revision=revision + 1):
                await self._apply(event.kind, event.key, event.value)
        except (EtcdUnavailable, EtcdError) as exc:
            _log.warning("cluster.watch_failed", node=self.node_id, error=str(exc))
            await trio.sleep(RETRY_SECONDS)

    async def _apply(self, kind: str, key: str, value: bytes) -> None:
        if key.startswith(self.prefix + "nodes/"):
            node = key.removeprefix(self.prefix + "nodes/")
            if kind == "put":
                self.members[node] = self._decoder.decode(value)
            else:
                self.members.pop(node, None)
                if node == self.node_id and self.state == "ok":
                    self._set_state("rejoining")  # our lease expired: etcd removed us
            self.on_change()
        elif key == self.prefix + "leader":
            self.leader = value.decode() if kind == "put" else None
            self.on_change()
            if self.leader is None:
                await self._campaign()

    async def _campaign(self) -> None:
        """Become the leader if there is none (compare-and-create under this node's lease)."""
        if self.state != "ok":
            return
        try:
            if await self.etcd.create(self.prefix + "leader", self.node_id.encode(), lease=self.lease):
                self.leader = self.node_id
                _log.info("cluster.leader", node=self.node_id, lease=self.lease)
                self.on_change()
        except (EtcdUnavailable, EtcdError) as exc:
            _log.warning("cluster.campaign_failed", node=self.node_id, error=str(exc))
