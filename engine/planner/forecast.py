"""The planner's forecast: the load of the next provisioning lead time, from the arrivals seen so far
(docs/planner.md).

`Forecaster` cuts the node's (the cluster's, on the leader) cumulative arrival counters into intervals of
`interval` seconds (`--autoscale-forecast-interval`) and feeds each interval's rates — prompt tokens/s,
requests/s and asked output tokens/s — to one predictor each (`engine.planner.predictors`, all of the
same kind, `--autoscale-predictor`). `forecast(horizon)` asks them for the intervals that cover the
next `horizon` seconds and gives the largest prediction of each (clamped to `--autoscale-forecast-clamp`
× the largest interval seen), with the mean lengths they imply: the load a replica decided now must be
ready for when it serves. The planner makes that forecast its floor (`engine.planner.loop`), sized to
its 0.9 quantile: the prompt-token predictor's one-interval errors over the last `ERRORS` intervals give
a spread, and the floor takes the prediction plus 1.28 × it (`Forecast.tokens_per_s_q90`).

Intervals close as samples arrive (one per planner pass): the arrivals counted since the last close are
the interval's, so a pass every `--autoscale-period` (≤ the interval) measures each one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final, final

from engine.planner.predictors import Clamp, Predictor, PredictorName, make_predictor
from messages.cluster import LoadTotals

RECENT: Final = 5  # intervals the observed rates are averaged over
ERRORS: Final = 20  # one-step errors of the prompt-token predictor the spread is measured over
Z_Q90: Final = 1.2816  # the standard normal's 0.9 quantile: the floor's quantile of the forecast


@final
@dataclass(frozen=True, slots=True)
class Forecast:
    """The load of the next `horizon_s` seconds as `predictor` sees it, and what it saw lately."""

    predictor: PredictorName
    horizon_s: float
    tokens_per_s: float  # prompt tokens arriving per second, the most over the horizon
    requests_per_s: float
    output_tokens_per_s: float  # output tokens asked for (max_tokens) per second
    observed_tokens_per_s: float  # over the last RECENT intervals
    observed_requests_per_s: float
    intervals: int  # intervals observed so far
    tokens_spread: float = 0.0  # the root mean square of the predictor's recent one-interval errors

    @property
    def tokens_per_s_q90(self) -> float:
        """The 0.9 quantile of the prompt tokens/s forecast: the prediction plus 1.28 × its recent error's
        spread (errors taken as normal) — what the floor is sized to."""
        return self.tokens_per_s + Z_Q90 * self.tokens_spread

    @property
    def mean_prompt_tokens(self) -> float:
        return self.tokens_per_s / self.requests_per_s if self.requests_per_s > 0 else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return self.output_tokens_per_s / self.requests_per_s if self.requests_per_s > 0 else 0.0


@final
class Forecaster:
    """See the module docstring."""

    def __init__(self, name: PredictorName, *, interval: float, season_s: float, clamp: float) -> None:
        if interval <= 0:
            raise ValueError(f"the forecast interval must be positive, got {interval}")
        season = max(2, round(season_s / interval))
        self.name, self.interval = name, interval
        self._series: dict[str, tuple[Predictor, Clamp]] = {
            key: (make_predictor(name, season=season), Clamp(clamp))
            for key in ("tokens", "requests", "output")
        }
        self._recent: deque[tuple[float, float]] = deque(maxlen=RECENT)
        self._errors: deque[float] = deque(maxlen=ERRORS)
        self._start: float | None = None
        self._base = LoadTotals()
        self.intervals = 0

    def sample(self, now: float, totals: LoadTotals) -> None:
        """Close every interval that ended by `now` (the first takes the arrivals since the last close)."""
        if self._start is None:
            self._start, self._base = now, totals
            return
        while now >= self._start + self.interval:
            self._close(totals)
            self._base = totals
            self._start += self.interval

    def _close(self, totals: LoadTotals) -> None:
        base, span = self._base, self.interval
        rates = {
            "tokens": (totals.arrived_tokens - base.arrived_tokens) / span,
            "requests": (totals.arrived_requests - base.arrived_requests) / span,
            "output": (totals.arrived_output_tokens - base.arrived_output_tokens) / span,
        }
        if self.intervals:
            tokens, clamp = self._series["tokens"]
            self._errors.append(rates["tokens"] - clamp(tokens.predict(1)[0]))
        for key, (predictor, clamp) in self._series.items():
            predictor.observe(rates[key])
            clamp.observe(rates[key])
        self._recent.append((rates["tokens"], rates["requests"]))
        self.intervals += 1

    def forecast(self, horizon_s: float) -> Forecast:
        steps = max(1, math.ceil(horizon_s / self.interval - 1e-9))

        def most(key: str) -> float:
            predictor, clamp = self._series[key]
            return max(clamp(v) for v in predictor.predict(steps))

        recent = list(self._recent)
        return Forecast(
            predictor=self.name,
            horizon_s=horizon_s,
            tokens_per_s=most("tokens"),
            requests_per_s=most("requests"),
            output_tokens_per_s=most("output"),
            observed_tokens_per_s=sum(t for t, _ in recent) / len(recent) if recent else 0.0,
            observed_requests_per_s=sum(r for _, r in recent) / len(recent) if recent else 0.0,
            intervals=self.intervals,
            tokens_spread=math.sqrt(sum(e * e for e in self._errors) / len(self._errors))
            if self._errors
            else 0.0,
        )
