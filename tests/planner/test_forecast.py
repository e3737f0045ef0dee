"""The planner's predictors against hand-computed series (a step, a ramp, a periodic load), the forecast
over intervals and a horizon, and the floor's rule: it raises the reactive count, never lowers it, and
never drives a scale-down (hypothesis over load series)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.planner.floor import decode_floor, lead_source, prefill_floor, with_floor
from engine.planner.forecast import Forecast, Forecaster
from engine.planner.formulas import Bounds, needed, target
from engine.planner.predictors import Clamp, Constant, Ewma, Kalman, Periodic, make_predictor
from messages.cluster import LoadTotals

PREFILL = Bounds(0.5, 0.7)
STEP = [10.0, 10.0, 10.0, 100.0, 100.0, 100.0]


def test_constant_holds_the_last_interval() -> None:
    constant = Constant()
    assert constant.predict(2) == [0.0, 0.0]
    for value in STEP[:3]:
        constant.observe(value)
    assert constant.predict(3) == [10.0, 10.0, 10.0]
    constant.observe(100.0)  # the step: seen at once
    assert constant.predict(1) == [100.0]


def test_ewma_follows_a_step_by_alpha() -> None:
    ewma = Ewma(alpha=0.5)
    for value in STEP:
        ewma.observe(value)
    # 10, 10, 10, then 10 + 0.5 * 90 = 55, 55 + 0.5 * 45 = 77.5, 77.5 + 0.5 * 22.5 = 88.75
    assert ewma.predict(2) == [88.75, 88.75]
    with pytest.raises(ValueError, match="alpha"):
        Ewma(alpha=0.0)


def test_kalman_by_hand_two_observations() -> None:
    """r = 0.1, q_level = 0.05, q_slope = 0.002. y0 = 1 sets level 1, slope 0, P = diag(0.1, 0.002).
    y1 = 2: predicted P = [[0.152, 0.002], [0.002, 0.004]], S = 0.252, gains 0.152/0.252 and
    0.002/0.252, residual 1."""
    kalman = Kalman(level_noise=0.05, slope_noise=0.002, observation_noise=0.1)
    assert kalman.predict(1) == [0.0]
    kalman.observe(math.e - 1)
    assert kalman.predict(2) == pytest.approx([math.e - 1] * 2)
    kalman.observe(math.e**2 - 1)
    level, slope = 1 + 0.152 / 0.252, 0.002 / 0.252
    assert kalman.level == pytest.approx(level) and kalman.slope == pytest.approx(slope)
    assert kalman.predict(2) == pytest.approx([math.expm1(level + slope), math.expm1(level + 2 * slope)])


def test_kalman_on_a_ramp_learns_its_growth() -> None:
    """A load growing 10 % an interval (log(1 + rate) rising by log 1.1): the filter's slope converges to
    it, and three intervals ahead it predicts the ramp's continuation within 2 %."""
    kalman = Kalman()
    series = [99.0 * 1.1**k + 1.1**k - 1 for k in range(40)]  # 1 + rate = 100 × 1.1^k
    for value in series:
        kalman.observe(value)
    assert kalman.slope == pytest.approx(math.log(1.1), rel=0.02)
    ahead = [100.0 * 1.1 ** (39 + k) - 1 for k in (1, 2, 3)]
    assert kalman.predict(3) == pytest.approx(ahead, rel=0.02)


def test_kalman_after_a_step_reaches_the_new_level() -> None:
    kalman = Kalman()
    for value in [10.0] * 20:
        kalman.observe(value)
    assert kalman.predict(1) == pytest.approx([10.0])
    after = []
    for _ in range(24):
        kalman.observe(100.0)
        after.append(kalman.predict(1)[0])
    # the trend carries it past the step (a burst reads as growth), then it settles on the new level
    assert after[1] > 90.0 and max(after) < 150.0
    assert after[-1] == pytest.approx(100.0, rel=0.02)


def test_periodic_predicts_the_profile_after_one_season() -> None:
    periodic = Periodic(season=4, alpha=0.5)
    for value in [0.0, 10.0, 0.0, 30.0]:
        periodic.observe(value)
    assert periodic.predict(4) == [0.0, 10.0, 0.0, 30.0]  # phase 0 next
    periodic.observe(4.0)  # phase 0 again: 0 + 0.5 × (4 − 0)
    assert periodic.predict(4) == [10.0, 0.0, 30.0, 2.0]
    young = Periodic(season=4, alpha=0.5)
    young.observe(8.0)
    young.observe(0.0)
    assert young.predict(2) == [4.0, 4.0]  # before a whole season: the EWMA level
    with pytest.raises(ValueError, match="season"):
        Periodic(season=1)


def test_the_clamp_keeps_a_prediction_within_factor_of_the_largest_seen() -> None:
    clamp = Clamp(2.0)
    for value in (5.0, 40.0, 20.0):
        clamp.observe(value)
    assert (clamp(-3.0), clamp(60.0), clamp(500.0)) == (0.0, 60.0, 80.0)


def _totals(tokens: int, requests: int, output: int = 0) -> LoadTotals:
    return LoadTotals(arrived_tokens=tokens, arrived_requests=requests, arrived_output_tokens=output)


def test_the_forecaster_cuts_intervals_and_takes_the_most_over_the_horizon() -> None:
    forecaster = Forecaster("periodic", interval=1.0, season_s=2.0, clamp=2.0)
    forecaster.sample(0.0, _totals(0, 0))
    # four intervals alternating 1000 and 3000 tokens/s (2 and 4 requests/s), sampled every 0.5 s
    cumulative = [(0.5, 500, 1, 10), (1.0, 1000, 2, 20), (1.5, 2500, 4, 40), (2.0, 4000, 6, 60)]
    cumulative += [(2.5, 4500, 7, 70), (3.0, 5000, 8, 80), (3.5, 6500, 10, 100), (4.0, 8000, 12, 120)]
    for now, tokens, requests, output in cumulative:
        forecaster.sample(now, _totals(tokens, requests, output))
    assert forecaster.intervals == 4
    one = forecaster.forecast(0.4)  # the next interval: phase 0 of the profile
    assert (one.tokens_per_s, one.requests_per_s) == (1000.0, 2.0)
    two = forecaster.forecast(1.5)  # two intervals: the larger
    assert (two.tokens_per_s, two.requests_per_s, two.output_tokens_per_s) == (3000.0, 4.0, 40.0)
    assert two.mean_prompt_tokens == 750.0 and two.mean_output_tokens == 10.0
    assert two.observed_tokens_per_s == 2000.0 and two.observed_requests_per_s == 3.0


def test_a_floor_per_role_from_the_forecast() -> None:
    forecast = Forecast("constant", 1.0, 7000.0, 7.0, 70.0, 3500.0, 3.5, 10)
    # 7000 tokens/s over 0.7 × 2000 per replica: 5 replicas
    assert prefill_floor(forecast, 2000.0, PREFILL) == 5
    assert prefill_floor(forecast, 0.0, PREFILL) == 0  # one replica's speed unknown: no floor
    # 600 blocks in use at 3.5 requests/s, 7 forecast: 1200 blocks over 0.95 × 512: 3 replicas
    assert decode_floor(forecast, 600, 512, Bounds(0.75, 0.95)) == 3
    # A predictor that erred by 1000 tokens/s lately: the 0.9 quantile is 7000 + 1.28 × 1000 = 8282,
    # over 1400 a replica: 6 replicas.
    spread = Forecast("constant", 1.0, 7000.0, 7.0, 70.0, 3500.0, 3.5, 10, tokens_spread=1000.0)
    assert spread.tokens_per_s_q90 == pytest.approx(8281.6)
    assert prefill_floor(spread, 2000.0, PREFILL) == 6
    assert lead_source(blitz=True, serving=True, host_copy=True) == "peer"
    assert lead_source(blitz=True, serving=False, host_copy=False) == "disk"
    assert lead_source(blitz=False, serving=True, host_copy=True) == "host"


def test_the_spread_is_the_predictors_recent_one_interval_error() -> None:
    """A steady load: the constant predictor never errs, no spread. Alternating 1000 and 3000 tokens/s:
    each interval misses by 2000 (the first has no prediction to judge), so the spread is 2000."""
    steady = Forecaster("constant", interval=1.0, season_s=2.0, clamp=2.0)
    alternating = Forecaster("constant", interval=1.0, season_s=2.0, clamp=2.0)
    steady.sample(0.0, _totals(0, 0))
    alternating.sample(0.0, _totals(0, 0))
    tokens = 0
    for second in range(1, 9):
        steady.sample(float(second), _totals(2000 * second, second))
        tokens += 1000 if second % 2 else 3000
        alternating.sample(float(second), _totals(tokens, second))
    assert steady.forecast(1.0).tokens_spread == 0.0
    assert alternating.forecast(1.0).tokens_spread == pytest.approx(2000.0)
    assert alternating.forecast(1.0).tokens_per_s_q90 == pytest.approx(3000.0 + 1.2816 * 2000.0)


def test_with_floor_raises_holds_and_never_lowers() -> None:
    assert with_floor(2, 2, 4, maximum=6) == 4  # within the band, below the floor: up to it
    assert with_floor(2, 3, 5, maximum=4) == 4  # the floor capped at the maximum
    assert with_floor(3, 2, 3, maximum=6) == 3  # a reactive scale-down below the floor: held
    assert with_floor(3, 2, 2, maximum=6) == 2  # ... at or above it: goes
    assert with_floor(3, 5, 1, maximum=6) == 5  # the reactive scale-up above it: as it is


@given(
    st.lists(st.floats(0.0, 20_000.0), min_size=5, max_size=60),
    st.sampled_from(["constant", "ewma", "kalman", "periodic"]),
)
def test_the_floor_is_never_below_the_reactive_count_on_the_way_down(load: list[float], name: str) -> None:
    """A planner pass per interval over a load series: from the same count, the count with the floor is
    never below the reactive rules' one, a step down is one replica, and it goes down only where the
    reactive rules would, never below the floor."""
    capacity, maximum = 2000.0, 12
    forecaster = Forecaster(name, interval=1.0, season_s=8.0, clamp=2.0)  # type: ignore[arg-type]
    forecaster.sample(0.0, _totals(0, 0))
    floored_count = 1
    tokens = 0.0
    for step, rate in enumerate(load, start=1):
        tokens += rate
        forecaster.sample(float(step), _totals(round(tokens), step))
        wanted = needed(rate, capacity, PREFILL)
        floor = prefill_floor(forecaster.forecast(1.0), capacity, PREFILL)
        before = floored_count
        reactive = target(before, wanted, minimum=1, maximum=maximum)
        floored_count = with_floor(before, reactive, floor, maximum=maximum)
        assert floored_count >= reactive
        assert floored_count >= before - 1
        if floored_count < before:
            assert reactive < before and floored_count >= floor


def test_make_predictor_names_every_kind() -> None:
    for name in ("constant", "ewma", "kalman", "periodic"):
        assert make_predictor(name, season=4).name == name  # type: ignore[arg-type]


def test_a_floor_that_only_holds_never_raises() -> None:
    assert with_floor(2, 2, 4, maximum=6, raises=False) == 2  # decode: below the floor, not raised
    assert with_floor(3, 2, 3, maximum=6, raises=False) == 3  # ... but a scale-down below it is held
    assert with_floor(2, 3, 5, maximum=6, raises=False) == 3  # the reactive scale-up as it is
