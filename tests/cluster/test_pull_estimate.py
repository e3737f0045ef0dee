"""The router's pull estimate (engine/prefix_pull.py): moving a prefix's KV against computing it, from
configured or measured speeds; `auto` pulls only while moving is the faster, and nothing before a speed
is known."""

from __future__ import annotations

from engine.prefix_pull import PullEstimate
from messages.cluster import LoadTotals

TOKEN = 4096  # KV bytes per token


def test_auto_pulls_when_the_link_moves_a_token_faster_than_prefill_computes_it() -> None:
    # 1,000 tokens/s computed; 1 Gbit/s = 125 MB/s moves 30,518 tokens/s: moving costs 0.033 of computing.
    estimate = PullEstimate("auto", kv_bytes_per_token=TOKEN, link_gbps=1.0, prefill_tokens_per_s=1000.0)
    ratio = estimate.ratio()
    assert ratio is not None and abs(ratio - 1000 * TOKEN / 125e6) < 1e-9
    assert abs(estimate.discount() - (1 - ratio)) < 1e-9
    slow = PullEstimate("auto", kv_bytes_per_token=TOKEN, link_gbps=0.01, prefill_tokens_per_s=1000.0)
    assert slow.discount() == 0.0  # 0.01 Gbit/s moves 305 tokens/s: computing is faster


def test_auto_measures_what_is_not_configured_and_waits_until_it_knows() -> None:
    totals = LoadTotals()
    estimate = PullEstimate("auto", kv_bytes_per_token=TOKEN, totals=lambda: totals)
    assert estimate.ratio() is None and estimate.discount() == 0.0
    totals = LoadTotals(prefilled_tokens=2000, prefill_busy_s=2.0, kv_bytes=TOKEN * 10_000, kv_seconds=1.0)
    assert estimate.speeds() == (1000.0, TOKEN * 10_000)
    assert abs(estimate.discount() - 0.9) < 1e-9


def test_off_and_always_do_not_estimate() -> None:
    assert PullEstimate("off", kv_bytes_per_token=TOKEN, link_gbps=100.0).discount() == 0.0
    assert PullEstimate("always", kv_bytes_per_token=TOKEN).discount() == 1.0
