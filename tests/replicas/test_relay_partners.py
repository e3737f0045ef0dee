"""An OldPrefill replica's partners: `live_partners` and `episode_over` only read; `prune`, once a pass,
is the one place a partner leaves (a local one out of the episode, a remote one whose report grace ran
out or that its node's reports dropped after reporting it NewPrefill)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from messages.commands import AddRelayPartner, ReplicaCommand
from replicas.inbox import CommandRefused
from replicas.signals import Changes
from replicas.states import ReplicaState
from replicas.zigzag.old_prefill import REPORT_GRACE, OldPrefillWork

S = ReplicaState


@dataclass
class Partner:
    """A replica the OldPrefill addresses: its state as this node sees it; what it was told."""

    name: str
    state: ReplicaState
    told: list[ReplicaCommand] = field(default_factory=list)

    def tell(self, command: ReplicaCommand) -> None:
        self.told.append(command)

    async def ask(self, command: ReplicaCommand, *, timeout: float = 30.0) -> Any:
        raise CommandRefused("not_found", f"{self.name} answers no ask here")


@dataclass
class Replicas:
    """This node's replicas by name, and the other nodes' as their last reports list them."""

    here: dict[str, Partner] = field(default_factory=dict)
    reported: list[Partner] = field(default_factory=list)

    def get(self, name: str) -> Partner | None:
        return self.here.get(name)

    def local(self) -> list[Partner]:
        return list(self.here.values())

    def remote(self) -> list[Partner]:
        return self.reported


@dataclass
class Loop:
    """The OldPrefill's actor: helper tasks are recorded, not run (the report watch and a told remote
    partner's ask are not what is tested)."""

    name: str = "old"
    state: ReplicaState = S.OLD_PREFILL
    spawned: list[Callable[..., Any]] = field(default_factory=list)

    def post(self, item: object = None) -> None:
        pass

    def later(self, apply: Callable[[], None]) -> None:
        apply()

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        self.spawned.append(fn)


def old_prefill(replicas: Replicas) -> OldPrefillWork:
    """Only the partner bookkeeping runs: nothing here computes, asks or receives."""
    return OldPrefillWork(
        Loop(),  # type: ignore[arg-type]
        prefill=None,  # type: ignore[arg-type]
        kv=None,  # type: ignore[arg-type]
        relay_endpoint=None,  # type: ignore[arg-type]
        fabric=None,  # type: ignore[arg-type]
        settings=None,  # type: ignore[arg-type]
        compute=None,  # type: ignore[arg-type]
        directory=replicas,  # type: ignore[arg-type]
        requests=None,  # type: ignore[arg-type]
        changes=Changes(),
    )


def test_predicates_only_read_and_prune_is_where_partners_leave() -> None:
    async def main() -> None:
        near = Partner("near", S.NEW_PREFILL)
        far = Partner("far", S.LOADING_PREFILL)
        replicas = Replicas(here={"near": near})
        work = old_prefill(replicas)
        work.pair("near")
        work.pair("far")  # on another node, not listed yet: in the episode for its grace
        assert isinstance(near.told[0], AddRelayPartner)
        assert work.live_partners() == ["near", "far"]
        near.state = S.PREFILL  # the local partner left the episode
        for _ in range(2):  # asked twice: same answer, nothing forgotten
            assert work.live_partners() == ["far"]
            assert not work.episode_over()
            assert work.partners == ["near", "far"]
        work.prune()
        assert work.partners == ["far"]
        # Its node reports it NewPrefill: the grace no longer applies once a pass saw it.
        far.state = S.NEW_PREFILL
        replicas.reported.append(far)
        work.prune()
        assert work.partners == ["far"]
        replicas.reported.clear()  # its node's reports drop it (the node left), within the grace
        assert trio.current_time() < REPORT_GRACE + 1
        assert work.live_partners() == [] and work.episode_over()
        assert work.partners == ["far"]
        work.prune()
        assert work.partners == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_remote_partner_leaves_when_its_grace_runs_out_unreported() -> None:
    async def main() -> None:
        replicas = Replicas()
        work = old_prefill(replicas)
        work.pair("far")
        assert work.live_partners() == ["far"]
        await trio.sleep(REPORT_GRACE)  # the mock clock: no real wait
        assert work.live_partners() == [] and work.episode_over()
        assert work.partners == ["far"]
        work.prune()
        assert work.partners == []

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
