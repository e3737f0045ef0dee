"""The TTFT-SLO rule (`engine.planner.slo`): it asks for a replica when the misses call for one, judges
the replica once it serves, and stops asking above a count whose added replica did not lower the misses."""

from __future__ import annotations

from engine.planner.slo import HELPED, RENEW, SloRule

WINDOW = 2.0


def rule() -> SloRule:
    return SloRule(ttft=0.3, miss=0.05, window=WINDOW)


def test_off_without_an_slo() -> None:
    off = SloRule(ttft=0.0, miss=0.05, window=WINDOW)
    assert not off.wants_more(now=10.0, count=1, settling=0, misses=0.9, last_up=0.0)
    assert not off.holds_down(count=1, misses=0.9)


def test_asks_only_when_settled_and_a_window_after_the_last_scale_up() -> None:
    slo = rule()
    assert not slo.wants_more(now=10.0, count=2, settling=0, misses=0.04, last_up=0.0)  # under the fraction
    assert not slo.wants_more(now=10.0, count=2, settling=1, misses=0.2, last_up=0.0)  # one still loads
    assert not slo.wants_more(now=10.0, count=2, settling=0, misses=0.2, last_up=9.0)  # too soon
    assert slo.wants_more(now=10.0, count=2, settling=0, misses=0.2, last_up=0.0)
    assert slo.holds_down(count=2, misses=0.2)
    assert not slo.holds_down(count=2, misses=0.01)


def test_a_replica_that_helped_keeps_the_rule_going() -> None:
    slo = rule()
    slo.asked(now=0.0, count=3, misses=0.2)
    # loading: not judged, whatever the misses
    assert not slo.wants_more(now=5.0, count=3, settling=1, misses=0.2, last_up=0.0)
    slo.wants_more(now=6.0, count=3, settling=0, misses=0.2, last_up=0.0)  # serves from 6 s
    assert slo.stopped_at is None  # judged only a window after it serves
    assert slo.wants_more(now=6.0 + WINDOW, count=3, settling=0, misses=0.1, last_up=0.0)  # halved
    assert slo.stopped_at is None


def test_a_replica_that_did_not_help_stops_the_rule_above_the_count_before_it() -> None:
    slo = rule()
    slo.asked(now=0.0, count=4, misses=0.10)
    slo.wants_more(now=1.0, count=4, settling=0, misses=0.10, last_up=0.0)
    misses = HELPED * 0.10 + 0.01  # did not fall enough
    assert not slo.wants_more(now=1.0 + WINDOW, count=4, settling=0, misses=misses, last_up=0.0)
    assert slo.stopped_at == 3
    assert not slo.holds_down(count=4, misses=misses)  # the band may scale it down again
    assert slo.holds_down(count=3, misses=misses)  # ... but not below the count that helped
    assert slo.wants_more(now=10.0, count=2, settling=0, misses=misses, last_up=0.0)  # below: it asks
    assert not slo.wants_more(now=10.0, count=3, settling=0, misses=misses, last_up=0.0)
    # the load changed: the misses rose well above those it stopped at
    assert slo.wants_more(now=20.0, count=3, settling=0, misses=RENEW * 0.10, last_up=0.0)
    assert slo.stopped_at is None
