"""The planner's predictors: the next few intervals of a load series from its history (docs/planner.md).

A predictor sees one value per interval (`observe`: arriving prompt tokens/s, or requests/s, over one
`--autoscale-forecast-interval`) and predicts the values of the next `steps` intervals (`predict`). Each
is a small closed state machine with no clock; the forecast (`engine.planner.forecast`) feeds it.

- `constant`: the last interval's value, held.
- `ewma`: an exponentially weighted mean, `level += alpha × (value − level)`, held.
- `kalman`: a local-linear-trend Kalman filter on `y = log(1 + value)`: the state is a level and a slope,
  `level' = level + slope + noise`, `slope' = slope + noise`, observed with noise; `k` steps ahead it
  predicts `exp(level + k × slope) − 1`. The logarithm keeps a rate positive and makes a burst a
  proportional change.
- `periodic`: a profile over one `season` (so many intervals): the value at each phase, learnt as an
  EWMA of the values seen at that phase; it predicts the profile at the coming phases once a whole season
  was seen, and the `ewma` level until then.

Every prediction is clamped (`Clamp`) to `[0, factor × the largest value observed]`, so no predictor
asks for more than `factor` (2 by default) times the load it has seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, Protocol, assert_never, final

PredictorName = Literal["constant", "ewma", "kalman", "periodic"]
PREDICTORS: Final[tuple[PredictorName, ...]] = ("constant", "ewma", "kalman", "periodic")


class Predictor(Protocol):
    @property
    def name(self) -> PredictorName: ...

    def observe(self, value: float) -> None: ...

    def predict(self, steps: int) -> list[float]:
        """The next `steps` intervals' values (unclamped; `steps` ≥ 1)."""
        ...


@final
class Constant:
    name: Final[PredictorName] = "constant"

    def __init__(self) -> None:
        self.last = 0.0

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self, steps: int) -> list[float]:
        return [self.last] * steps


@final
class Ewma:
    name: Final[PredictorName] = "ewma"

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the EWMA's alpha must lie in (0, 1], got {alpha}")
        self.alpha = alpha
        self.level: float | None = None

    def observe(self, value: float) -> None:
        self.level = value if self.level is None else self.level + self.alpha * (value - self.level)

    def predict(self, steps: int) -> list[float]:
        return [self.level or 0.0] * steps


@final
class Kalman:
    """Local linear trend on log(1 + value); `level_noise`, `slope_noise` and `observation_noise` are the
    variances of the level's and the slope's steps and of an observation around the level (in log units
    squared). The first observation sets the level with the observation's variance and a slope of 0."""

    name: Final[PredictorName] = "kalman"

    def __init__(
        self, *, level_noise: float = 0.05, slope_noise: float = 0.002, observation_noise: float = 0.1
    ) -> None:
        if min(level_noise, slope_noise, observation_noise) < 0 or observation_noise == 0:
            raise ValueError("the Kalman filter's noise variances must be >= 0 (the observation's > 0)")
        self.q_level, self.q_slope, self.r = level_noise, slope_noise, observation_noise
        self.level = 0.0
        self.slope = 0.0
        # The state's covariance [[a, b], [b, c]].
        self.a, self.b, self.c = 0.0, 0.0, 0.0
        self.started = False

    def observe(self, value: float) -> None:
        y = math.log1p(max(0.0, value))
        if not self.started:
            self.started = True
            self.level, self.slope = y, 0.0
            self.a, self.b, self.c = self.r, 0.0, self.q_slope
            return
        # Predict: x = F x, P = F P Fᵀ + Q with F = [[1, 1], [0, 1]].
        level, slope = self.level + self.slope, self.slope
        a = self.a + 2 * self.b + self.c + self.q_level
        b = self.b + self.c
        c = self.c + self.q_slope
        # Update with H = [1, 0].
        s = a + self.r
        gain_level, gain_slope = a / s, b / s
        residual = y - level
        self.level = level + gain_level * residual
        self.slope = slope + gain_slope * residual
        self.a = (1 - gain_level) * a
        self.b = (1 - gain_level) * b
        self.c = c - gain_slope * b

    def predict(self, steps: int) -> list[float]:
        if not self.started:
            return [0.0] * steps
        return [math.expm1(self.level + k * self.slope) for k in range(1, steps + 1)]


@final
class Periodic:
    """A profile over `season` intervals (see the module docstring); `alpha` weighs each phase's newest
    value against its profile, and the level used before a whole season was seen."""

    name: Final[PredictorName] = "periodic"

    def __init__(self, season: int, alpha: float = 0.5) -> None:
        if season < 2:
            raise ValueError(f"a periodic profile needs a season of at least 2 intervals, got {season}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the profile's alpha must lie in (0, 1], got {alpha}")
        self.season, self.alpha = season, alpha
        self.profile: list[float | None] = [None] * season
        self.seen = 0  # intervals observed; the next one's phase is `seen % season`
        self.level = Ewma(alpha)

    def observe(self, value: float) -> None:
        phase = self.seen % self.season
        old = self.profile[phase]
        self.profile[phase] = value if old is None else old + self.alpha * (value - old)
        self.level.observe(value)
        self.seen += 1

    def predict(self, steps: int) -> list[float]:
        if self.seen < self.season:
            return self.level.predict(steps)
        return [self.profile[(self.seen + k) % self.season] or 0.0 for k in range(steps)]


@final
@dataclass(slots=True)
class Clamp:
    """Predictions kept within `[0, factor × the largest value observed]`."""

    factor: float = 2.0
    largest: float = 0.0

    def observe(self, value: float) -> None:
        self.largest = max(self.largest, value)

    def __call__(self, predicted: float) -> float:
        return min(max(predicted, 0.0), self.factor * self.largest)


def make_predictor(name: PredictorName, *, season: int) -> Predictor:
    """A fresh predictor of that name (`season`: intervals per period, for `periodic`)."""
    match name:
        case "constant":
            return Constant()
        case "ewma":
            return Ewma()
        case "kalman":
            return Kalman()
        case "periodic":
            return Periodic(season)
        case _:
            assert_never(name)
