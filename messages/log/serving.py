"""The node's own account of its serving, for a person watching it; part of the
`messages.log.events.LogEvent` union."""

from __future__ import annotations

from messages.log.base import Event


class ServingSummary(Event, frozen=True, kw_only=True, tag="serving_summary"):
    """The node's periodic one-line account of the last `interval_s` (`--log-summary-period`), emitted
    when something happened in it: requests now running (admitted, not ended) and waiting for a replica,
    those that ended in the interval by outcome, the prompt tokens prefilled and the tokens generated
    per second over it, the KV blocks in use across the replicas (0-100), and the replicas serving."""

    interval_s: float
    running: int
    waiting: int
    finished: int
    failed: int
    cancelled: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    kv_used_percent: float
    serving_replicas: int
    replicas: int
