"""A seeded schedule of faults for a cluster of hosts (`engine.hosts.cluster`).

Faults (`Fault`):
- `partition`: a host's link is cut for `partition_s` seconds (longer than the lease TTL: the host's
  nodes lose their leases), then restored;
- `kill`: a node is killed with SIGKILL and started again (same `--node-id`) once its lease ended;
- `etcd`: etcd is killed with SIGKILL and started again at once, on the same data;
- `leader`: the node that holds the `leader` key is killed with SIGKILL and started again once its lease
  ended.

`make_schedule(seed, ...)` spaces the faults `period_s` apart, the first at `period_s`: with `kinds`
given, exactly those (in the order the seed shuffles them), else as many as fit in `seconds`, each kind
drawn by the seed with `weights`. Targets (`host`, `node`) are drawn by the seed too; the leader is
whoever leads when the fault starts. The same seed and arguments always give the same schedule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

FaultKind = Literal["partition", "kill", "etcd", "leader"]
KINDS: Final[tuple[FaultKind, ...]] = ("partition", "kill", "etcd", "leader")
# The operator's mix: partitions and kills most, etcd and the leader now and then.
WEIGHTS: Final = {"partition": 4, "kill": 3, "etcd": 1, "leader": 2}


@final
@dataclass(frozen=True, slots=True)
class Fault:
    """One fault: `at_s` seconds after the load started; `target` the host (partition) or node (kill);
    empty for `etcd` and `leader`."""

    at_s: float
    kind: FaultKind
    target: str = ""

    def describe(self) -> str:
        return f"{self.at_s:g}s {self.kind}" + (f" {self.target}" if self.target else "")


def make_schedule(
    seed: int,
    *,
    seconds: float,
    period_s: float,
    hosts: Sequence[str],
    nodes: Sequence[str],
    kinds: Sequence[FaultKind] | None = None,
    weights: dict[str, int] = WEIGHTS,
) -> list[Fault]:
    """See the module docstring."""
    rng = random.Random(seed)
    if kinds is not None:
        chosen = list(kinds)
        rng.shuffle(chosen)
    else:
        count = max(1, int(seconds // period_s) - 1)
        population = list(KINDS)
        chosen = rng.choices(population, weights=[weights[k] for k in population], k=count)
    faults = []
    for index, kind in enumerate(chosen):
        target = ""
        if kind == "partition":
            target = rng.choice(list(hosts))
        elif kind == "kill":
            target = rng.choice(list(nodes))
        faults.append(Fault(at_s=period_s * (index + 1), kind=kind, target=target))
    return faults
