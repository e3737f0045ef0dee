"""The planner loop (`--autoscale`, docs/planner.md): scales prefill and decode by the load.

Every `--autoscale-period` seconds — on the cluster's leader, or on a node alone — one pass reads the
signals (`Signals`: waiting prompt tokens, rates over `--autoscale-window`, decode KV blocks, replica
counts, this node's and every other member's as last reported), computes each role's range and target
(`engine.planner.formulas`), raised to the floor the forecast of the next provisioning lead time sets
(`--autoscale-predictor`, `engine.planner.forecast`, `engine.planner.floor`; a scale-down stays
reactive and never passes below it), and logs a `planner_decision` event with what it read and the
forecast (a `keep` or `skip` that repeats the role's last one word for word, at most once a second). It
moves at most one role per pass, through the `scale` op of the node it places the change on, and makes no decision while a
scale runs, or for `--autoscale-pause-after-manual` seconds after a manual one. Scaling up with policy
`blitz` runs prefill through ZigZag with weights from any source (`auto`); `serverless` is stop-the-world
from the host copy or disk. With `--autoscale-advisory` it decides and logs, and changes nothing (no
scale, no release). A replica scaled down keeps its weights (`ShuttingNull`) for
`--autoscale-keep-alive` seconds — a scale-up in that time revives it — then is made `Inactive`.

`inject(signals)` replaces the measured load (tests drive the planner with a known load); the replica
counts are always the measured ones.

Cancellation: `run` sleeps between passes; a pass cancelled mid-scale leaves the scale's replicas in the
states its commands reached (every command is answered by the replica's own loop).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Final, Literal, Protocol, TypeVar, final

import msgspec
import trio

from engine.control.errors import RequestFailed
from engine.core import NodeCore
from engine.logs.load import LoadCounters
from engine.planner.floor import decode_floor, lead_source, planner_forecast, prefill_floor, with_floor
from engine.planner.forecast import Forecast, Forecaster
from engine.planner.formulas import (
    Bounds,
    Range,
    decode_by_memory,
    decode_by_migration,
    prefill_by_tokens,
    target,
)
from engine.planner.queueing import prefill_by_delay
from engine.planner.signals import Rates, RateWindow, add, with_capacity
from engine.planner.slo import SloRule
from engine.scaling import scale
from messages.cluster import LoadTotals, Report
from messages.commands import Transition
from messages.control import ControlRequest, ScaleMode, ScaleRequest, SourceChoice
from messages.control_replies import ScaleResult
from messages.log.scaling import PlannerDecision, PlannerForecast, PlannerInputs
from replicas.actor import Replica
from replicas.inbox import CommandRefused, new_command_id
from replicas.ports import PeerReplica
from replicas.states import ACTIVE_STATES, SETTLED, ReplicaState

R = TypeVar("R")


class Cluster(Protocol):
    """What the planner asks of the cluster its node is a member of (`engine.cluster`)."""

    @property
    def node_id(self) -> str: ...

    @property
    def is_leader(self) -> bool: ...

    def reports(self) -> Mapping[str, Report]:
        """Every other member's last report, by node."""
        ...

    def place(self, wanted: str | None) -> str: ...

    async def forward(self, node: str, request: ControlRequest, result_type: type[R]) -> R: ...


Role = Literal["prefill", "decode"]
ROLES: Final[tuple[Role, ...]] = ("prefill", "decode")
PLANNER_ID: Final = "planner"
QUIET_LOG_S: Final = 1.0  # a `keep` or `skip` the same as the role's last one is logged at most this often


@final
@dataclass(frozen=True, slots=True)
class Signals:
    """One pass's inputs (see the module docstring); `counts` are the active replicas per role."""

    waiting_tokens: int
    rates: Rates
    decode_used_blocks: int
    decode_blocks_per_replica: int
    counts: dict[str, int]
    # Active replicas not yet serving plainly (loading, in a ZigZag episode, reviving) per role.
    settling: dict[str, int] = field(default_factory=dict)
    totals: LoadTotals = field(default_factory=LoadTotals)  # the cumulative counters read (the forecast's)

    def inputs(self) -> PlannerInputs:
        r = self.rates
        return PlannerInputs(
            waiting_tokens=self.waiting_tokens,
            arriving_tokens_per_s=r.arriving_tokens_per_s,
            prefill_tokens_per_s=r.prefill_tokens_per_s,
            decode_used_blocks=self.decode_used_blocks,
            decode_blocks_per_replica=self.decode_blocks_per_replica,
            migration_bytes_per_s=r.migration_bytes_per_s,
            migration_bytes_per_s_per_replica=r.migration_bytes_per_s_per_replica,
            slo_miss_fraction=r.slo_miss_fraction,
            arriving_requests_per_s=r.arriving_requests_per_s,
        )


@final
class Planner:
    """See the module docstring: the planner of node `core`, reading its `load` counters and, in a
    cluster, the other members' reports (`cluster`)."""

    def __init__(self, core: NodeCore, load: LoadCounters, *, cluster: Cluster | None = None) -> None:
        self.node = core
        self.load = load
        self.cluster = cluster
        self.config = config = core.config.autoscale
        self.window = RateWindow(config.autoscale_window)
        self.injected: Signals | None = None
        self.paused_until = 0.0
        self._idle_since: dict[str, float] = {}  # ShuttingNull replicas: since when
        self._below_since: dict[str, float] = {}  # roles whose range lies below their count: since when
        self._last_up: dict[str, float] = {}
        self._logged: dict[str, tuple[float, tuple[object, ...]]] = {}  # role → last `keep`/`skip` logged
        predictor = config.autoscale_predictor
        self.forecaster = (
            None
            if predictor == "none"
            else Forecaster(
                predictor,
                interval=config.autoscale_forecast_interval,
                season_s=config.autoscale_forecast_season,
                clamp=config.autoscale_forecast_clamp,
            )
        )
        self._forecasts: dict[str, PlannerForecast | None] = {}  # role → this pass's forecast and floor
        load.slo = (config.autoscale_slo_ttft, config.autoscale_slo_ttft_per_token)
        self.slo = SloRule(
            ttft=config.autoscale_slo_ttft, miss=config.autoscale_slo_miss, window=config.autoscale_window
        )
        self.bounds = {
            "prefill": Bounds(config.prefill_utilization_lower, config.prefill_utilization_upper),
            "decode": Bounds(config.decode_utilization_lower, config.decode_utilization_upper),
            "migration": Bounds(config.migration_utilization_lower, config.migration_utilization_upper),
        }

    def inject(self, signals: Signals | None) -> None:
        self.injected = signals

    def manual_scale(self) -> None:
        """A person scaled: the planner waits `--autoscale-pause-after-manual` seconds."""
        self.paused_until = trio.current_time() + self.config.autoscale_pause_after_manual

    async def run(self) -> None:
        """A pass every period; in between it wakes when a keep-alive ends, to release at that time."""
        next_pass = trio.current_time() + self.config.autoscale_period
        while True:
            await trio.sleep_until(min(next_pass, self._next_release()))
            cluster = self.cluster
            if cluster is not None and not cluster.is_leader:
                next_pass = max(next_pass, trio.current_time())
                continue
            now = trio.current_time()
            if not self.config.autoscale_advisory:
                await self._release_idle(now)
            if now >= next_pass:
                next_pass = now + self.config.autoscale_period
                await self.step()

    # ------------------------------------------------------------------ one pass
    async def step(self) -> None:
        now = trio.current_time()
        signals = self.measure(now)
        if self.injected is not None:  # a known load; the replica counts stay the node's own
            signals = replace(
                self.injected, counts=signals.counts, settling=signals.settling, totals=signals.totals
            )
        self._floors(now, signals)
        busy = self.node.scale_lock.locked()
        if busy or now < self.paused_until:
            skipped = "a scale is running" if busy else "paused after a manual scale"
            for role in ROLES:
                count = signals.counts.get(role, 0)
                self._log(role, "skip", count, count, Range(count, count), skipped, signals)
            return
        for role in ROLES:
            current = signals.counts.get(role, 0)
            wanted, slo_asked = self.wanted(role, signals, now)
            maximum = self._limit(role, "max")
            reactive = target(current, wanted, minimum=self._limit(role, "min"), maximum=maximum)
            forecast = self._forecasts.get(role)
            floor = 0 if forecast is None else forecast.floor
            # Decode's floor only holds a scale-down: its forecast (blocks scaled by the arrival rate)
            # overshoots with the predictor, and a decode scale-up takes the pass and the scale lock.
            chosen = with_floor(current, reactive, floor, maximum=maximum, raises=role == "prefill")
            why = self._hold(role, current, reactive, now, signals)
            if chosen > reactive:  # the floor raises the count, or holds it against a scale-down
                why = None if chosen > current else f"the forecast's floor ({floor}) holds the count"
            if why is not None:
                self._log(role, "keep", current, current, wanted, why, signals)
                continue
            action: Literal["scale_up", "scale_down"] = "scale_up" if chosen > current else "scale_down"
            because = "out of range" if chosen == reactive else f"below the forecast's floor ({floor})"
            self._log(role, action, current, chosen, wanted, because, signals)
            if self.config.autoscale_advisory:
                continue  # decided and logged; nothing changes
            if chosen > current:
                self._last_up[role] = now
                if slo_asked and chosen == reactive:
                    self.slo.asked(now=now, count=chosen, misses=signals.rates.slo_miss_fraction)
            self._below_since.pop(role, None)
            await self._apply(role, current, chosen)
            return  # one role per pass: the next pass sees what this scale did

    def _floors(self, now: float, signals: Signals) -> None:
        """Feed the forecast this pass's counters and set each role's floor for the lead time of the
        source a scale-up would copy from (`engine.planner.floor`)."""
        if self.forecaster is None:
            return
        self.forecaster.sample(now, signals.totals)
        serving = sum(signals.counts.values()) > sum(signals.settling.values())
        source = lead_source(
            blitz=self.config.autoscale_policy == "blitz",
            serving=serving,
            host_copy=self.node.host.host_copy is not None,
        )
        measured = self.load.lead.seconds(source)
        horizon = self.config.autoscale_lead_time if measured is None else measured
        forecast: Forecast = self.forecaster.forecast(horizon)
        floors = {
            "prefill": prefill_floor(forecast, signals.rates.prefill_tokens_per_s, self.bounds["prefill"]),
            "decode": decode_floor(
                forecast, signals.decode_used_blocks, signals.decode_blocks_per_replica, self.bounds["decode"]
            ),
        }
        self._forecasts = {
            role: planner_forecast(forecast, None if measured is None else source, floor)
            for role, floor in floors.items()
        }

    def _hold(self, role: Role, current: int, chosen: int, now: float, signals: Signals) -> str | None:
        """Why the count stays (None: move to `chosen`). A scale-down waits until the range has stayed
        below the count for `--autoscale-down-after` seconds since it fell there and since the last
        scale-up, and until no replica of the role is still loading (it could not be shut down)."""
        if chosen == current:
            self._below_since.pop(role, None)
            return "within range"
        if chosen > current:
            return None
        since = self._below_since.setdefault(role, now)
        wait = self.config.autoscale_down_after
        if now - max(since, self._last_up.get(role, -wait)) < wait:
            return f"below range for less than {wait:g} s"
        if signals.settling.get(role, 0):
            return "a replica of the role is still loading"
        if role == "prefill" and self.slo.holds_down(count=current, misses=signals.rates.slo_miss_fraction):
            return "more first tokens than --autoscale-slo-miss missed the TTFT SLO in the window"
        return None

    def wanted(self, role: Role, signals: Signals, now: float) -> tuple[Range, bool]:
        """The role's range, and whether the SLO rule raised it (prefill only: a scale-up it asked for
        is reported back to the rule, which judges it)."""
        rates = signals.rates
        if role == "prefill":
            wanted = prefill_by_tokens(
                rates.arriving_tokens_per_s,
                signals.waiting_tokens,
                rates.prefill_tokens_per_s,
                self.bounds["prefill"],
                drain_s=self.config.autoscale_drain,
            )
            if self.config.autoscale_slo_ttft > 0 and rates.arriving_requests_per_s > 0:
                mean_prompt = rates.arriving_tokens_per_s / rates.arriving_requests_per_s
                delay = prefill_by_delay(
                    arriving_tokens_per_s=rates.arriving_tokens_per_s,
                    requests_per_s=rates.arriving_requests_per_s,
                    waiting_tokens=signals.waiting_tokens,
                    tokens_per_s_per_replica=rates.prefill_tokens_per_s,
                    slo_s=max(
                        self.config.autoscale_slo_ttft, self.config.autoscale_slo_ttft_per_token * mean_prompt
                    ),
                    maximum=self._limit(role, "max"),
                )
                wanted = Range(max(wanted.low, delay), max(wanted.high, delay))
            current = signals.counts.get(role, 0)
            slo_asked = self.slo.wants_more(
                now=now,
                count=current,
                settling=signals.settling.get(role, 0),
                misses=signals.rates.slo_miss_fraction,
                last_up=self._last_up.get(role, -math.inf),
            )
            if slo_asked:  # the band does not hold the SLO: one more than now
                wanted = Range(max(wanted.low, current + 1), max(wanted.high, current + 1))
            return wanted, slo_asked
        memory = decode_by_memory(
            signals.decode_used_blocks, max(1, signals.decode_blocks_per_replica), self.bounds["decode"]
        )
        migration = decode_by_migration(
            rates.migration_bytes_per_s, rates.migration_bytes_per_s_per_replica, self.bounds["migration"]
        )
        return memory.widest(migration), False

    def _limit(self, role: Role, which: Literal["min", "max"]) -> int:
        return int(getattr(self.config, f"{which}_{role}_replicas"))

    # ------------------------------------------------------------------ signals
    def measure(self, now: float) -> Signals:
        """This node's signals plus every other member's last report."""
        node = self.node
        totals = self.load.totals
        waiting = node.router.pending_tokens
        counts: dict[str, int] = {role: 0 for role in ROLES}
        settling: dict[str, int] = {role: 0 for role in ROLES}
        used, per_replica = 0, []
        for snap in (replica.snapshot() for replica in node.directory.local()):
            for role in ROLES:
                if snap.state in ACTIVE_STATES[role]:
                    counts[role] += 1
                    settling[role] += snap.state not in SETTLED
            waiting += snap.queued_prompt_tokens
            if snap.state is ReplicaState.DECODE:
                used += snap.cached_blocks
                per_replica.append(snap.kv_blocks)
        cluster = self.cluster
        for report in [] if cluster is None else list(cluster.reports().values()):
            totals = add(totals, report.load)
            waiting += report.pending_tokens
            for r in report.replicas:
                state = ReplicaState(r.status.state)
                for role in ROLES:
                    if state in ACTIVE_STATES[role]:
                        counts[role] += 1
                        settling[role] += state not in SETTLED
                waiting += r.queued_prompt_tokens
                if state is ReplicaState.DECODE:
                    used += r.status.cached_blocks
                    per_replica.append(r.kv_total)
        rates = with_capacity(
            self.window.sample(now, totals),
            prefill_tokens_per_s=self.config.prefill_tokens_per_s,
            migration_bytes_per_s=self.config.migration_bytes_per_s,
        )
        blocks = sum(per_replica) // len(per_replica) if per_replica else 0
        return Signals(waiting, rates, used, blocks, counts, settling, totals)

    # ------------------------------------------------------------------ acting
    async def _apply(self, role: Role, current: int, chosen: int) -> None:
        """Scale `role` by `chosen - current` on one node: up where `scale` would place a replica (this
        node while it has a free slot), down on the node with the most of them."""
        node = self.node
        blitz = self.config.autoscale_policy == "blitz"
        up = chosen > current
        mode: ScaleMode = "zigzag" if blitz and up and role == "prefill" else "stop_the_world"
        source: SourceChoice = "auto" if blitz else ("host" if node.host.host_copy is not None else "disk")
        counts = self._counts_per_node(role)
        cluster = self.cluster
        if cluster is None:
            where = None
        elif up:
            where = cluster.place(None)
        else:
            this = cluster.node_id
            where = max(counts, key=lambda n: (counts[n], n == this))
        here = counts.get(where or "", 0)
        request = ScaleRequest(
            id=PLANNER_ID,
            role=role,
            replicas=max(0, here + chosen - current),
            mode=mode if up else None,
            source=source,
        )
        try:
            if cluster is not None and where is not None and where != cluster.node_id:
                await cluster.forward(where, msgspec.structs.replace(request, node=where), ScaleResult)
                return
            if mode == "zigzag" and not any(r.state is ReplicaState.PREFILL for r in node.directory.local()):
                request = msgspec.structs.replace(
                    request, mode="stop_the_world"
                )  # ZigZag needs a serving one
            await scale(node, request, origin="planner")
        except RequestFailed as exc:
            self._log(
                role, "skip", current, chosen, Range(chosen, chosen), f"the scale failed: {exc.message}", None
            )

    def _counts_per_node(self, role: Role) -> dict[str, int]:
        """Active replicas of `role` per node id (this node under its id, or "" alone)."""
        mine = sum(1 for r in self.node.directory.local() if r.state in ACTIVE_STATES[role])
        cluster = self.cluster
        if cluster is None:
            return {"": mine}
        counts = {cluster.node_id: mine}
        for other, report in cluster.reports().items():
            counts[other] = sum(
                1 for r in report.replicas if ReplicaState(r.status.state) in ACTIVE_STATES[role]
            )
        return counts

    def _idle(self) -> dict[str, tuple[Replica | PeerReplica, float]]:
        """`ShuttingNull` replicas and since when: this node's from their state change, the others'
        from when a report first showed them there."""
        now = trio.current_time()
        idle: dict[str, tuple[Replica | PeerReplica, float]] = {
            r.name: (r, r.state_since)
            for r in self.node.directory.local()
            if r.state is ReplicaState.SHUTTING_NULL
        }
        for peer in self.node.directory.remote():
            if peer.state is ReplicaState.SHUTTING_NULL:
                idle[peer.name] = (peer, self._idle_since.get(peer.name, now))
        self._idle_since = {name: since for name, (_, since) in idle.items()}
        return idle

    def _next_release(self) -> float:
        ends = [since + self.config.autoscale_keep_alive for _, since in self._idle().values()]
        return min(ends, default=math.inf)

    async def _release_idle(self, now: float) -> None:
        """`ShuttingNull` replicas idle past the keep-alive are made `Inactive` (their weights released),
        this node's and, in a cluster, the others' (as last reported)."""
        for name, (replica, since) in self._idle().items():
            if now - since < self.config.autoscale_keep_alive:
                continue
            command = Transition(
                command_id=new_command_id(), to=ReplicaState.INACTIVE.value, origin="planner"
            )
            try:
                await replica.ask(command)
            except CommandRefused:
                continue  # revived meanwhile (a scale-up took it back)
            self._idle_since.pop(name, None)
            configured = replica.snapshot().role  # the role its pools were made for, not its name
            if configured == "encode":
                continue  # decisions are logged per prefill or decode role; its state change logs this one
            role: Role = configured
            self._log(
                role, "release", 0, 0, Range(0, 0), f"{name} idle past the keep-alive: weights released", None
            )

    def _log(
        self,
        role: Role,
        action: Literal["keep", "scale_up", "scale_down", "release", "skip"],
        current: int,
        chosen: int,
        wanted: Range,
        reason: str,
        signals: Signals | None,
    ) -> None:
        advisory = self.config.autoscale_advisory and action in ("scale_up", "scale_down")
        if (
            action in ("keep", "skip") or advisory
        ):  # a pass that changes nothing: logged when it says something new
            said = (action, current, chosen, wanted, reason)
            now = trio.current_time()
            last = self._logged.get(role)
            if last is not None and last[1] == said and now - last[0] < QUIET_LOG_S:
                return
            self._logged[role] = (now, said)
        inputs = (signals or self.injected or _EMPTY).inputs()
        self.node.log.emit(
            PlannerDecision(
                role=role,
                policy=self.config.autoscale_policy,
                action=action,
                current=current,
                target=chosen,
                low=wanted.low,
                high=wanted.high,
                reason=reason,
                inputs=inputs,
                forecast=self._forecasts.get(role) if signals is not None else None,
                advisory=advisory,
            )
        )


_EMPTY = Signals(0, Rates(), 0, 0, {})
