"""The forecast's floor: the replicas each role needs for the load forecast over the provisioning lead
time, and how that floor combines with the reactive target (docs/planner.md). Pure functions.

- prefill: the forecast's 0.9 quantile of prompt tokens/s (`Forecast.tokens_per_s_q90`: the prediction
  plus 1.28 × its recent errors' spread — a mean-sized floor is short half the time) over one replica's
  tokens/s, at the band's `upper` utilisation (the fewest replicas at or below it);
- decode: the KV blocks in use now, scaled by the forecast request rate over the one observed lately (the
  blocks a unit of arrival rate holds stay as they are), at the KV band's `upper`;
- `with_floor`: the reactive rules (BlitzScale's band, `engine.planner.formulas.target`) act above the
  floor — a prefill count below it moves up to it; a scale-down stays reactive (one replica, after the
  hysteresis) and never goes below the floor. So the count with a floor is never below the reactive one.
  Decode's floor only holds (it never scales decode up): the blocks it scales by the forecast rate
  overshoot with the predictor, and a decode scale-up takes the pass and the scale lock from prefill.

The horizon is the lead time of the source a scale-up would copy from (`lead_source`): `auto` (blitz)
takes a peer when a replica serves, else the host copy, else disk; serverless the host copy or disk.
"""

from __future__ import annotations

import math

from engine.planner.forecast import Forecast
from engine.planner.formulas import Bounds, needed
from messages.log.scaling import PlannerForecast, WeightsSourceName


def prefill_floor(forecast: Forecast, tokens_per_s_per_replica: float, bounds: Bounds) -> int:
    if tokens_per_s_per_replica <= 0.0:
        return 0  # one replica's speed not measured yet: no floor
    return needed(forecast.tokens_per_s_q90, tokens_per_s_per_replica, bounds).low


def decode_floor(forecast: Forecast, used_blocks: int, blocks_per_replica: int, bounds: Bounds) -> int:
    if forecast.observed_requests_per_s <= 0.0 or blocks_per_replica <= 0:
        return 0
    blocks = used_blocks * forecast.requests_per_s / forecast.observed_requests_per_s
    return needed(blocks, float(blocks_per_replica), bounds).low


def with_floor(current: int, chosen: int, floor: int, *, maximum: int, raises: bool = True) -> int:
    """The count to move to: `chosen` (the reactive target) raised to `floor` (capped at `maximum`; with
    `raises` False, never raised: the floor only holds); a reactive scale-down that would pass below the
    floor holds the count instead."""
    floor = min(floor, maximum)
    if chosen >= current:
        return max(chosen, floor) if raises else chosen
    return chosen if chosen >= floor else current


def lead_source(*, blitz: bool, serving: bool, host_copy: bool) -> WeightsSourceName:
    if blitz and serving:
        return "peer"
    return "host" if host_copy else "disk"


def planner_forecast(forecast: Forecast, source: WeightsSourceName | None, floor: int) -> PlannerForecast:
    """The forecast as the `planner_decision` event names it (`source` None: the lead time not measured)."""

    def finite(x: float) -> float:
        return x if math.isfinite(x) else 0.0

    return PlannerForecast(
        predictor=forecast.predictor,
        horizon_s=round(forecast.horizon_s, 4),
        lead_source=source,
        arriving_tokens_per_s=round(finite(forecast.tokens_per_s), 1),
        arriving_tokens_per_s_q90=round(finite(forecast.tokens_per_s_q90), 1),
        requests_per_s=round(finite(forecast.requests_per_s), 3),
        mean_prompt_tokens=round(finite(forecast.mean_prompt_tokens), 1),
        mean_output_tokens=round(finite(forecast.mean_output_tokens), 1),
        floor=floor,
    )
