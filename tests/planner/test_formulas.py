"""The planner's target formulas on recorded inputs, and their invariants (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.logs.load import LoadCounters
from engine.planner.formulas import (
    Bounds,
    Range,
    decode_by_memory,
    decode_by_migration,
    needed,
    prefill_by_tokens,
    target,
)
from engine.planner.signals import RateWindow
from messages.cluster import LoadTotals
from messages.log.events import FirstToken, PrefillFinished, RequestArrived, TransferFinished

PREFILL = Bounds(0.5, 0.7)
DECODE = Bounds(0.75, 0.95)
MIGRATION = Bounds(0.4, 0.8)


def test_decode_by_kv_memory() -> None:
    # 3000 blocks used, 1024 per replica: 3000 / (0.95 * 1024) = 3.08 -> 4; 3000 / (0.75 * 1024) = 3.9 -> 4
    assert decode_by_memory(3000, 1024, DECODE) == Range(4, 4)
    # 1500 used: 1.54 -> 2 ... 1.95 -> 2
    assert decode_by_memory(1500, 1024, DECODE) == Range(2, 2)
    assert decode_by_memory(0, 1024, DECODE) == Range(0, 0)


def test_decode_by_migration_bandwidth() -> None:
    # 10 GB/s to move, 5 GB/s per replica: 10 / (0.8 * 5) = 2.5 -> 3; 10 / (0.4 * 5) = 5
    assert decode_by_migration(10e9, 5e9, MIGRATION) == Range(3, 5)
    assert decode_by_migration(10e9, 0.0, MIGRATION) == Range(0, 0)  # nothing measured: no signal


def test_prefill_by_waiting_tokens() -> None:
    # 2000 tokens/s arriving + 4000 waiting drained in 2 s = 4000 tokens/s; 1000 per replica:
    # 4000 / (0.7 * 1000) = 5.7 -> 6; 4000 / (0.5 * 1000) = 8
    assert prefill_by_tokens(2000.0, 4000, 1000.0, PREFILL, drain_s=2.0) == Range(6, 8)
    assert prefill_by_tokens(0.0, 0, 1000.0, PREFILL, drain_s=2.0) == Range(0, 0)
    assert prefill_by_tokens(2000.0, 0, 0.0, PREFILL, drain_s=2.0) == Range(0, 0)


def test_target_keeps_a_count_in_range_and_moves_to_the_middle_otherwise() -> None:
    assert target(3, Range(2, 5), minimum=1, maximum=8) == 3
    assert target(1, Range(6, 8), minimum=1, maximum=8) == 7
    assert target(1, Range(6, 8), minimum=1, maximum=4) == 4  # the maximum
    assert target(5, Range(0, 0), minimum=1, maximum=8) == 4  # down one at a time
    assert target(1, Range(0, 0), minimum=1, maximum=8) == 1  # the minimum


def test_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match=r"need 0 < lower < upper <= 1, got 0.7, 0.5"):
        Bounds(0.7, 0.5)


@given(
    current=st.integers(0, 64),
    low=st.integers(0, 64),
    extra=st.integers(0, 64),
    minimum=st.integers(0, 8),
    spread=st.integers(0, 56),
)
def test_target_stays_within_limits_and_steps_down_by_one(
    current: int, low: int, extra: int, minimum: int, spread: int
) -> None:
    maximum = minimum + spread
    chosen = target(current, Range(low, low + extra), minimum=minimum, maximum=maximum)
    if chosen < current:
        assert chosen == current - 1
    else:
        assert chosen <= max(maximum, current)
        assert chosen >= min(minimum, current) or chosen == current
    if current in range(low, low + extra + 1) and minimum <= current <= maximum:
        assert chosen == current


@given(demand=st.floats(0.0, 1e6), capacity=st.floats(1e-3, 1e6))
def test_needed_replicas_keep_utilisation_within_bounds(demand: float, capacity: float) -> None:
    found = needed(demand, capacity, PREFILL)
    assert found.low <= found.high
    if found.low > 0:
        assert demand / (found.low * capacity) <= PREFILL.upper + 1e-6
        assert demand / (found.high * capacity) >= PREFILL.lower - 1e-6 or found.high == found.low


def test_rates_over_the_window() -> None:
    window = RateWindow(5.0)
    assert window.sample(0.0, LoadTotals()).arriving_tokens_per_s == 0.0
    later = LoadTotals(
        arrived_tokens=1000, prefilled_tokens=800, prefill_busy_s=0.4, kv_bytes=4000, kv_seconds=0.01
    )
    rates = window.sample(2.0, later)
    assert rates.arriving_tokens_per_s == 500.0
    assert rates.prefill_tokens_per_s == 2000.0
    assert rates.migration_bytes_per_s == 2000.0
    assert rates.migration_bytes_per_s_per_replica == pytest.approx(400_000.0)


def test_load_counters_count_a_batch_once() -> None:
    counters = LoadCounters()
    counters.observe(
        RequestArrived(
            request_id="a", connection=None, prompt_tokens=100, images=0, max_tokens=4, stream=False
        )
    )
    # two requests of one batch: they share its start (ts - seconds), so its seconds count once
    for request_id, tokens in (("a", 100), ("b", 60)):
        counters.observe(
            PrefillFinished(request_id=request_id, replica="prefill-0", ts=10.5, tokens=tokens, seconds=0.5)
        )
    counters.observe(PrefillFinished(request_id="c", replica="prefill-1", ts=10.5, tokens=40, seconds=0.5))
    counters.observe(
        TransferFinished(
            request_id="a",
            replica="decode-0",
            kind="kv",
            transfer_id="a/kv1",
            status="success",
            reason=None,
            rounds=1,
            tokens=100,
            bytes=4096,
            seconds=0.002,
            source="prefill-0",
            destination="decode-0",
            transport="inproc",
        )
    )
    assert counters.totals == LoadTotals(
        arrived_tokens=100,
        arrived_requests=1,
        arrived_output_tokens=4,  # the request's max_tokens
        prefilled_tokens=200,
        prefill_busy_s=1.0,
        kv_bytes=4096,
        kv_seconds=0.002,
    )


def test_load_counters_count_first_tokens_past_the_ttft_slo() -> None:
    counters = LoadCounters()
    counters.slo = (0.3, 0.001)  # 0.3 s, or 1 ms per prompt token
    for request_id, prompt in (("short", 100), ("long", 1000)):
        counters.observe(
            RequestArrived(
                request_id=request_id,
                connection=None,
                prompt_tokens=prompt,
                images=0,
                max_tokens=4,
                stream=False,
            )
        )
    counters.observe(FirstToken(request_id="short", token_id=1, ttft_s=0.4))  # past max(0.3, 0.1)
    counters.observe(FirstToken(request_id="long", token_id=1, ttft_s=0.9))  # within max(0.3, 1.0)
    assert (counters.totals.first_tokens, counters.totals.slo_misses) == (2, 1)
