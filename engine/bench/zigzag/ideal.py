"""Ideal models of the burst: the same arrivals and emulated speeds as a measured run, no overheads.

An old prefill replica serves whole prompts from the trace's start; a new one is scaled up at `scale_at`
and its layers land at `layer_times` (seconds from the trace's start, layer by layer — taken from the
run's own copy, its `weights_progress` events, so the model copies exactly as fast as the run did).
Three ways of using the new replica:

- **stop-the-world**: it serves whole prompts once its last layer landed;
- **instant**: it serves whole prompts from `scale_at` on, as if its copy took no time;
- **ideal ZigZag**: until its copy ends it runs the layers it holds for a prompt and the old replica runs
  the rest — no transfer, no batch to form, no relay protocol — and after, it serves whole prompts.

Every prompt, in arrival order, goes where it would finish first (first come, first served on each
replica, one prompt at a time: the emulated cost is linear in tokens, so batching changes no replica's
busy time). A prompt of `t` tokens costs `t / speed` seconds through the whole model, each of the `L`
layers `1 / L` of it. A relayed prompt runs layers `[0, k)` on the new replica from when that is free —
going through each layer that has landed by the time it gets there — and hands `[k, L)` to the old one, which
runs them once both the first part is done and it is free, `k` the handover that ends soonest. TTFT is the prompt's end less its arrival (the
first token comes with the prefill; decode is not modelled). The dispatch is greedy (earliest finish),
not a proven optimum: it is what the policy "every prompt through the layers the new replica holds,
wherever that ends sooner" reaches without any overhead, which the measured runs are judged against
(engine.bench zigzag's `-vs-ideal`, `-vs-instant` and `-stw-vs-model` rows; docs/zigzag.md). It is a
reference rather than a strict bound: a node that batches and lets the old replica serve its own queue
between relays can beat its median.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

ModelWay = Literal["stop_the_world", "instant", "ideal_zigzag"]
MODEL_WAYS: Final[tuple[ModelWay, ...]] = ("stop_the_world", "instant", "ideal_zigzag")


@final
@dataclass(frozen=True, slots=True)
class Prompt:
    at: float  # arrival, seconds from the trace's start
    tokens: int


@final
@dataclass(frozen=True, slots=True)
class Copy:
    """The new replica's copy as a run made it: when it began, and when each layer landed (sorted)."""

    scale_at: float
    layer_times: tuple[float, ...]

    def landed(self, at: float) -> int:
        """Layers landed by `at`."""
        return bisect.bisect_right(self.layer_times, at)

    @property
    def done(self) -> float:
        return self.layer_times[-1] if self.layer_times else self.scale_at


def ttfts(prompts: Sequence[Prompt], copy: Copy, *, speed: float, way: ModelWay) -> list[float]:
    """Each prompt's modelled TTFT, in arrival order (see the module docstring)."""
    if speed <= 0 or not copy.layer_times:
        raise ValueError("the model needs a positive speed and at least one layer")
    layers = len(copy.layer_times)
    whole_from = copy.scale_at if way == "instant" else copy.done
    old_free, new_free = 0.0, copy.scale_at
    out: list[float] = []
    for prompt in sorted(prompts, key=lambda p: p.at):
        cost = prompt.tokens / speed
        old_end = max(prompt.at, old_free) + cost
        new_start = max(prompt.at, new_free, whole_from)
        best = ("old", old_end, old_end, 0.0)
        if new_start + cost < best[1]:
            best = ("new", new_start + cost, new_start + cost, 0.0)
        if way == "ideal_zigzag" and prompt.at < copy.done:
            # The new replica runs layer after layer while each has landed by the time it gets there; the
            # old one runs the rest from the handover that ends soonest.
            clock = max(prompt.at, new_free)
            for layer, landed_at in enumerate(copy.layer_times[:-1]):
                if landed_at > clock:
                    break
                clock += cost / layers
                end = max(clock, old_free) + cost * (layers - layer - 1) / layers
                if end < best[1]:
                    best = ("relay", end, clock, end)
        where, end, new_until, old_until = best
        if where == "old":
            old_free = end
        elif where == "new":
            new_free = end
        else:
            new_free, old_free = new_until, old_until
        out.append(end - prompt.at)
    return out
