"""The prefill band's queueing formulas against M/M/1, M/M/2 and M/D/1 worked by hand, and the count they
ask for on loads where utilisation alone would keep one replica."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.planner.queueing import erlang_c, prefill_by_delay, wait_quantile


def test_erlang_c_by_hand() -> None:
    # M/M/1: an arrival waits with probability rho.
    assert erlang_c(1, 0.6) == pytest.approx(0.6)
    # M/M/2, offered load a: C = (a^2 / 2) / (1 - rho) / (1 + a + (a^2 / 2) / (1 - rho)), rho = a / 2.
    a = 1.5
    tail = (a * a / 2) / (1 - a / 2)
    assert erlang_c(2, a) == pytest.approx(tail / (1 + a + tail))
    assert erlang_c(3, 0.0) == 0.0 and erlang_c(2, 2.0) == 1.0
    with pytest.raises(ValueError, match="server"):
        erlang_c(0, 0.5)


def test_wait_quantiles_by_hand() -> None:
    # M/M/1, lambda 8/s, service 0.1 s (mu 10/s): P(W > t) = 0.8 exp(-2 t); the 0.9 quantile solves
    # 0.8 exp(-2 t) = 0.1: t = ln 8 / 2.
    assert wait_quantile(1, 8.0, 0.1, q=0.9, scv=1.0) == pytest.approx(math.log(8) / 2)
    # Equal prompts (M/D/1): half the M/M/1 wait (Allen-Cunneen, (1 + 0) / 2).
    assert wait_quantile(1, 8.0, 0.1, q=0.9) == pytest.approx(math.log(8) / 4)
    # An arrival waits less often than 1 - q: the quantile is no wait at all; unstable: forever.
    assert wait_quantile(1, 0.5, 0.1, q=0.9) == 0.0
    assert wait_quantile(1, 10.0, 0.1) == math.inf
    assert wait_quantile(2, 0.0, 0.1) == 0.0


def test_the_band_raised_where_utilisation_keeps_one_replica() -> None:
    # 10 prompts/s of 100 tokens on replicas of 2,000 tokens/s: utilisation 0.5 of one replica, within the
    # band's 0.7. One replica's 0.9 wait (M/D/1): 0.5 ln(0.5 / 0.1) / (20 - 10) = 0.080 s, plus 0.05 s of
    # service: past an SLO of 0.07 s. Two replicas wait with probability 0.1: no 0.9-quantile wait.
    load = {"arriving_tokens_per_s": 1000.0, "requests_per_s": 10.0, "tokens_per_s_per_replica": 2000.0}
    assert prefill_by_delay(**load, waiting_tokens=0, slo_s=0.07, maximum=4) == 2
    assert prefill_by_delay(**load, waiting_tokens=0, slo_s=0.14, maximum=4) == 1
    # A backlog of 400 tokens adds 0.1 s on two replicas, 0.067 s on three.
    assert prefill_by_delay(**load, waiting_tokens=400, slo_s=0.12, maximum=4) == 3
    # None within the cap: the cap. Nothing measured: no say (0).
    assert prefill_by_delay(**load, waiting_tokens=0, slo_s=0.01, maximum=4) == 4
    assert (
        prefill_by_delay(**{**load, "tokens_per_s_per_replica": 0.0}, waiting_tokens=0, slo_s=1, maximum=4)
        == 0
    )


@given(
    st.floats(1.0, 200.0),
    st.integers(16, 4000),
    st.floats(500.0, 20000.0),
    st.floats(0.05, 5.0),
    st.integers(0, 20000),
)
def test_more_load_or_a_tighter_slo_never_asks_for_fewer(
    requests_per_s: float, prompt: int, speed: float, slo: float, waiting: int
) -> None:
    def ask(rate: float, limit: float) -> int:
        return prefill_by_delay(
            arriving_tokens_per_s=rate * prompt,
            requests_per_s=rate,
            waiting_tokens=waiting,
            tokens_per_s_per_replica=speed,
            slo_s=limit,
            maximum=64,
        )

    base = ask(requests_per_s, slo)
    assert 1 <= base <= 64
    assert ask(requests_per_s * 1.5, slo) >= base
    assert ask(requests_per_s, slo / 2) >= base
