"""The node's fault hooks (architecture §7) as one object, handed to the parts that can fault.

The node builds one `FaultHooks` from its `--fault` options; the parts call it at the points a fault can
strike — a replica's loop step (`fail_replica`), a transfer endpoint's plan (`stall_sender`,
`drop_link`), a landed transfer (`corrupt_transfer`), a weight copy's next piece (`hold_weights`). No
part reads the fault list itself, and the default, `NO_FAULTS`, does nothing at any of them. Every fault
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
        self.faults = tuple(faults)
        self._fail_after = {f.replica: f.after_steps for f in self.faults if isinstance(f, FailReplica)}
        self._steps: Counter[str] = Counter()
        self._landed: Counter[TransferKindName] = Counter()
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
        for fault in self.faults:
            if isinstance(fault, StallSender) and fault.replica == replica:
                plan = FaultPlan(stall_before_round=0, stall_seconds=fault.seconds)
            elif isinstance(fault, DropLink) and fault.source == replica:
                plan = FaultPlan(drop_link_after_bytes=max(1, fault.after_bytes))
        return plan

    def landed(
        self, kind: TransferKindName, log: _Log, detail: Callable[[int], str], alter: Callable[[], None]
    ) -> None:
        """A transfer of `kind` finished landing on this node (the `index`-th, from 0, in finishing
        order): a `corrupt_transfer` fault for it calls `alter` — which changes the landed data so that
        the output must change — and logs `detail(index)`."""
        if not self.faults:
            return
        index = self._landed[kind]
        self._landed[kind] += 1
        if any(
            isinstance(fault, CorruptTransfer) and fault.transfer == kind and fault.nth in (None, index)
            for fault in self.faults
        ):
            alter()
            log.emit(FaultInjected(fault="corrupt_transfer", detail=detail(index)))

    async def before_layer(self, replica: str, copy: int, position: int, layers: int, log: _Log) -> bool:
        """Weight copy number `copy` (of the node, from 1) into `replica` is about to load layer
        `position` (`layers`: the final norm and head). A `hold_weights` fault for it holds the copy for
        its seconds, or until `release_holds`; returns whether it held."""
        for fault in self.faults:
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

    @property
    def keepalive_block(self) -> BlockKeepalive | None:
        """The `block_keepalive` fault of a cluster node, if any."""
        return next((f for f in self.faults if isinstance(f, BlockKeepalive)), None)


NO_FAULTS = FaultHooks()
