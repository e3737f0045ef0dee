"""The node's fault hooks (architecture §7) as one object, handed to the parts that can fault.

The node builds one `FaultHooks` from its `--fault` options; the parts call it at the points a fault can
strike — a replica's loop step (`fail_replica`), a transfer endpoint's plan (`stall_sender`,
`drop_link`), a landed KV or embedding transfer (`corrupt_transfer`: how the landed data is altered
lives here, not in the roles), a weight copy's next piece (`hold_weights`), a cluster node's lease
keepalives (`block_keepalive`). No part reads the fault list or a fault's fields itself, and the default, `NO_FAULTS`, does nothing at any of them. Every fault
that fires is logged as a `fault_injected` event.

A hold (`hold_weights`) lasts its `seconds` at most; `release_holds` — the `release` control op — ends
every hold in progress at once, so a test that holds a copy half-way lets it go when it has seen what
it waited for instead of guessing a time.

Counters (steps per replica, landed transfers per kind) are node-wide and live here; the parts keep none.
Cancellation: a hold is a plain wait; cancelling it (the replica stops) leaves nothing behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol, final

import torch
import trio

from messages.faults import (
    BlockKeepalive,
    CorruptTransfer,
    DropLink,
    FailReplica,
    Fault,
    HoldWeights,
    StallSender,
    TransferKindName,
)
from messages.log.events import FaultInjected, LogEvent
from replicas.model import KVCache
from transport.faults import NO_FAULTS as NO_TRANSFER_FAULTS
from transport.faults import FaultPlan


class _Log(Protocol):
    def emit(self, event: LogEvent) -> None: ...


@final
class InjectedFault(Exception):
    """Raised by the `fail_replica` fault hook inside a replica's loop."""


@final
class FaultHooks:
    """See the module docstring. One per node; single Trio thread."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self._faults = tuple(faults)
        self._fail_after = {f.replica: f.after_steps for f in self._faults if isinstance(f, FailReplica)}
        self._steps: Counter[str] = Counter()
        self._landed_count: Counter[TransferKindName] = Counter()
        self._release = trio.Event()
        self.holding = 0  # holds in progress

    def loop_step(self, replica: str, log: _Log) -> None:
        """`replica`'s main loop ended one more step; raises `InjectedFault` once it is past the steps
        its `fail_replica` fault names (once per replica)."""
        if replica not in self._fail_after:
            return
        self._steps[replica] += 1
        if self._steps[replica] > self._fail_after[replica]:
            del self._fail_after[replica]
            log.emit(
                FaultInjected(fault="fail_replica", detail=f"after {self._steps[replica] - 1} loop steps")
            )
            raise InjectedFault(f"{replica}: injected failure (fail_replica fault hook)")

    def transfer_plan(self, replica: str) -> FaultPlan:
        """What `replica`'s transfer endpoints inject as senders (a stall, a dropped link; the last
        fault naming it wins)."""
        plan = NO_TRANSFER_FAULTS
        for fault in self._faults:
            if isinstance(fault, StallSender) and fault.replica == replica:
                plan = FaultPlan(stall_before_round=0, stall_seconds=fault.seconds)
            elif isinstance(fault, DropLink) and fault.source == replica:
                plan = FaultPlan(drop_link_after_bytes=max(1, fault.after_bytes))
        return plan

    def corrupt_landed_kv(
        self,
        log: _Log,
        kv: KVCache,
        table: Sequence[int],
        tokens: int,
        *,
        transfer_id: str,
        request_id: str,
        replica: str,
    ) -> None:
        """KV transfer `transfer_id` of `request_id` finished landing on `replica` (its `tokens` rows in
        `table`): a `corrupt_transfer` fault for it alters the landed K of layer 0, so the output must
        change. `nth` counts the KV transfers that landed on this node, from 0, in finishing order."""

        def alter() -> None:
            rows = kv.slot_rows(table, 0, tokens)
            keys = kv.keys(0)
            keys.index_copy_(0, rows, -keys.index_select(0, rows) * 3.0 + 1.0)

        self._landed(
            "kv",
            log,
            lambda index: (
                f"kv transfer {transfer_id} of request {request_id} altered "
                f"(kv transfer {index} of the node, received by {replica})"
            ),
            alter,
        )

    def corrupt_landed_embeddings(self, log: _Log, embeds: torch.Tensor, *, replica: str) -> None:
        """An embedding transfer finished landing on `replica` as the rows `embeds`: a `corrupt_transfer`
        fault for it alters them, so the output must change. `nth` counts the embedding transfers that
        landed on this node, from 0, in finishing order."""
        self._landed(
            "embedding",
            log,
            lambda index: f"embedding transfer {index} of the node (on {replica}) altered",
            lambda: embeds.mul_(-3.0).add_(1.0),
        )

    def _landed(
        self, kind: TransferKindName, log: _Log, detail: Callable[[int], str], alter: Callable[[], object]
    ) -> None:
        """A transfer of `kind` finished landing on this node (the `index`-th, from 0, in finishing
        order): a `corrupt_transfer` fault for it calls `alter` and logs `detail(index)`."""
        if not self._faults:
            return
        index = self._landed_count[kind]
        self._landed_count[kind] += 1
        if any(
            isinstance(fault, CorruptTransfer) and fault.transfer == kind and fault.nth in (None, index)
            for fault in self._faults
        ):
            alter()
            log.emit(FaultInjected(fault="corrupt_transfer", detail=detail(index)))

    async def before_layer(self, replica: str, copy: int, position: int, layers: int, log: _Log) -> bool:
        """Weight copy number `copy` (of the node, from 1) into `replica` is about to load layer
        `position` (`layers`: the final norm and head). A `hold_weights` fault for it holds the copy for
        its seconds, or until `release_holds`; returns whether it held."""
        for fault in self._faults:
            if (
                isinstance(fault, HoldWeights)
                and fault.before_layer == position
                and fault.replica in (None, replica)
                and fault.nth in (None, copy)
            ):
                where = f"layer {position}" if position < layers else "the final norm and head"
                log.emit(
                    FaultInjected(
                        fault="hold_weights",
                        detail=f"weight copy {copy} held {fault.seconds:g} s before {where}",
                    )
                )
                release = self._release
                self.holding += 1
                try:
                    with trio.move_on_after(fault.seconds):
                        await release.wait()
                finally:
                    self.holding -= 1
                return True
        return False

    def release_holds(self) -> int:
        """End every `hold_weights` hold in progress now (the `release` control op); returns how many."""
        held = self.holding
        release, self._release = self._release, trio.Event()
        release.set()
        return held

    def keepalive_blocked(self, since_joined: float) -> bool:
        """Whether a cluster node's `block_keepalive` fault holds back its lease keepalives now,
        `since_joined` seconds after it joined (from `after_s` on, for `seconds`)."""
        return any(
            isinstance(f, BlockKeepalive) and f.after_s <= since_joined < f.after_s + f.seconds
            for f in self._faults
        )


NO_FAULTS = FaultHooks()
