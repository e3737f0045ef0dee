"""Whether moving a cached prefix is cheaper than computing it: the router's pull estimate
(docs/prefix-cache.md, "Pulls"; `--prefix-pull auto|off|always`).

`ratio` is the seconds to move one prompt token's KV over the seconds to compute it:

    ratio = prefill tokens/s × KV bytes per token / link bytes/s

- prefill tokens/s: the emulated figure (`--emulated-speed prefill_tokens_per_s=N`) when one is set, else
  what this node's prefill replicas measured while they computed (`LoadTotals.prefilled_tokens /
  prefill_busy_s`);
- link bytes/s: `--prefix-pull-link-gbps` when set, else what this node's KV migrations measured while
  they moved (`kv_bytes / kv_seconds`; a pull moves the same blocks over the same links).

`discount` is the share of a pulled block's cost the router saves against computing it: `off` 0 (no
pulls); `always` 1 (a prefix anywhere counts as held by every replica); `auto` 1 − ratio when the ratio
is known and below 1, else 0 — before either speed is measured, nothing is pulled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, final

from messages.cluster import LoadTotals

PullMode = Literal["auto", "off", "always"]


@final
class PullEstimate:
    """See the module docstring. `totals` reads this node's measured load (`engine.planner.signals`);
    `kv_bytes_per_token` is the KV of one token, every layer."""

    def __init__(
        self,
        mode: PullMode,
        *,
        kv_bytes_per_token: int,
        link_gbps: float | None = None,
        prefill_tokens_per_s: float | None = None,
        totals: Callable[[], LoadTotals] = LoadTotals,
    ) -> None:
        self.mode: PullMode = mode
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link_gbps = link_gbps
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.totals = totals

    def speeds(self) -> tuple[float | None, float | None]:
        """(prefill tokens/s, link bytes/s), configured or measured; None where neither."""
        totals = self.totals()
        prefill = self.prefill_tokens_per_s
        if prefill is None and totals.prefill_busy_s > 0 and totals.prefilled_tokens > 0:
            prefill = totals.prefilled_tokens / totals.prefill_busy_s
        link = None if self.link_gbps is None else self.link_gbps * 1e9 / 8
        if link is None and totals.kv_seconds > 0 and totals.kv_bytes > 0:
            link = totals.kv_bytes / totals.kv_seconds
        return prefill, link

    def ratio(self) -> float | None:
        """Seconds to move a token's KV over seconds to compute it; None while a speed is unknown."""
        prefill, link = self.speeds()
        if prefill is None or link is None:
            return None
        return prefill * self.kv_bytes_per_token / link

    def discount(self) -> float:
        """What a pulled block saves, as a share of computing it (0: no pulls)."""
        if self.mode == "off":
            return 0.0
        if self.mode == "always":
            return 1.0
        ratio = self.ratio()
        return 0.0 if ratio is None or ratio >= 1.0 else 1.0 - ratio
