"""The TTFT-SLO rule for prefill (`--autoscale-slo-ttft`, docs/planner.md): when the first tokens miss
the SLO, another replica — unless the replicas it already added did not help.

- **Asks for one more** when more first tokens than `--autoscale-slo-miss` missed the SLO over the
  window, judged only once no prefill replica is loading and a window has passed since the last
  scale-up (so the misses counted are those of the replicas there are now).
- **Holds a scale-down** while the misses stay above that fraction.
- **Judges what it added.** A replica the rule asked for is judged a window after it serves: when the
  misses did not fall below `HELPED` of what they were when it was asked for, they are not for want of
  replicas — requests queue inside the node behind a batch, whatever the count — and the rule stops: it
  asks for no more than the count before that replica and holds no scale-down above it, so the band
  (and the forecast's floor) size prefill again; below that count it still asks. It starts again
  in full when the misses rise to `RENEW` × what they were when it stopped (the load changed).

A pure state machine driven by the planner's passes (`now`: the Trio clock); no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, final

HELPED: Final = 0.8  # the misses must fall below this share of what they were for an added replica to count
RENEW: Final = 1.5  # misses this many times those at which the rule stopped start it again


@final
@dataclass(slots=True)
class _Added:
    count: int  # the prefill replicas once the added one serves
    misses: float  # the miss fraction when it was asked for
    serving_since: float | None = None  # since when no prefill replica loads (None: one still does)


@final
class SloRule:
    """See the module docstring. `ttft` ≤ 0: the SLO is not told, and the rule never acts."""

    def __init__(self, *, ttft: float, miss: float, window: float) -> None:
        self.enabled = ttft > 0
        self.miss = miss
        self.window = window
        self._added: _Added | None = None
        self.stopped_at: int | None = None  # the count above which the rule stopped acting
        self._stopped_misses = 0.0

    def missed(self, misses: float) -> bool:
        return self.enabled and misses > self.miss

    def wants_more(self, *, now: float, count: int, settling: int, misses: float, last_up: float) -> bool:
        """Whether the misses call for one replica more than `count` (see the module docstring)."""
        self._judge(now, count, settling, misses)
        if not self.missed(misses) or settling or now - last_up < self.window:
            return False
        return self.stopped_at is None or count < self.stopped_at

    def holds_down(self, *, count: int, misses: float) -> bool:
        """Whether the misses hold prefill at `count` against a scale-down."""
        return self.missed(misses) and (self.stopped_at is None or count <= self.stopped_at)

    def asked(self, *, now: float, count: int, misses: float) -> None:
        """The planner scaled prefill up to `count` because the rule asked."""
        self._added = _Added(count=count, misses=misses)

    def _judge(self, now: float, count: int, settling: int, misses: float) -> None:
        if self.stopped_at is not None and misses >= RENEW * self._stopped_misses:
            self.stopped_at = None  # the load changed: the rule acts again
        added = self._added
        if added is None:
            return
        if settling:
            added.serving_since = None
            return
        if added.serving_since is None:
            added.serving_since = now
        if now - added.serving_since < self.window:
            return  # not yet a window of the added replica serving
        self._added = None
        if count >= added.count and misses > HELPED * added.misses:
            self.stopped_at = added.count - 1
            self._stopped_misses = added.misses
