"""The prefill band sized by queueing: the fewest replicas whose predicted wait keeps first tokens within
the TTFT SLO (docs/planner.md). Pure functions: no clock, no node.

Utilisation alone does not say when prompts wait: at 0.7 of a replica, an M/D/1 queue's mean wait is
already 1.2 service times. So the prefill range's low end is raised to the fewest replicas `k` for which

    backlog / (k × speed)  +  wait_q(k)  +  service  ≤  SLO(mean prompt)

where `service = mean prompt tokens / speed` (one replica's measured or configured tokens/s),
`backlog` the prompt tokens already waiting, and `wait_q(k)` the `q` quantile of the wait of a prompt
arriving at `requests_per_s` on `k` replicas: the M/M/k tail, `P(W > t) = C(k, a) × exp(−(kμ − λ) t)`
(Erlang's C, offered load `a = λ / μ`), scaled by the Allen–Cunneen factor `(ca² + cs²) / 2` for Poisson
arrivals (`ca² = 1`) and prompts of squared coefficient of variation `cs²` (0: equal prompts, an M/D/k
queue, half the M/M/k wait). Tests check the formulas against M/M/1 and M/D/1 by hand.
"""

from __future__ import annotations

import math

QUANTILE = 0.9  # the wait quantile the band holds within the SLO


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/`servers` queue of offered load `offered` = λ/μ
    (1 when the queue is unstable, `offered` ≥ `servers`)."""
    if servers < 1:
        raise ValueError(f"a queue needs a server, got {servers}")
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    # Erlang B by its recurrence (stable for any count), then C from B.
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1.0 - rho + rho * b)


def wait_quantile(
    servers: int, requests_per_s: float, service_s: float, *, q: float = QUANTILE, scv: float = 0.0
) -> float:
    """The `q` quantile of a prompt's wait in the queue, seconds (inf when the queue is unstable)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile lies in (0, 1), got {q}")
    if requests_per_s <= 0.0 or service_s <= 0.0:
        return 0.0
    mu = 1.0 / service_s
    drain = servers * mu - requests_per_s
    if drain <= 0.0:
        return math.inf
    waits = erlang_c(servers, requests_per_s * service_s)
    if waits <= 1.0 - q:
        return 0.0
    return (1.0 + scv) / 2.0 * math.log(waits / (1.0 - q)) / drain


def prefill_by_delay(
    *,
    arriving_tokens_per_s: float,
    requests_per_s: float,
    waiting_tokens: int,
    tokens_per_s_per_replica: float,
    slo_s: float,
    maximum: int,
    scv: float = 0.0,
    q: float = QUANTILE,
) -> int:
    """The fewest prefill replicas, 1 to `maximum`, whose predicted `q`-quantile TTFT (module docstring)
    is within `slo_s` for a prompt of the mean length; `maximum` when none is; 0 when nothing is measured
    (no arrivals, or one replica's speed unknown: the band's utilisation rule alone decides)."""
    if requests_per_s <= 0.0 or arriving_tokens_per_s <= 0.0 or tokens_per_s_per_replica <= 0.0:
        return 0
    service = arriving_tokens_per_s / requests_per_s / tokens_per_s_per_replica
    for servers in range(1, maximum + 1):
        backlog = waiting_tokens / (servers * tokens_per_s_per_replica)
        wait = wait_quantile(servers, requests_per_s, service, q=q, scv=scv)
        if backlog + wait + service <= slo_s:
            return servers
    return maximum
