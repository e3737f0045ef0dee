"""The ideal models of the ZigZag burst (engine/bench/zigzag/ideal.py) on cases computed by hand: 1,000
prompt tokens/s, prompts of 1,000 tokens (1 s through the whole model)."""

from __future__ import annotations

import pytest

from engine.bench.zigzag.ideal import Copy, Prompt, ttfts

TWO_AT_ZERO = [Prompt(0.0, 1000), Prompt(0.0, 1000)]


def test_instant_serves_on_both_replicas_from_the_scale() -> None:
    assert ttfts(TWO_AT_ZERO, Copy(0.0, (2.0,)), speed=1000.0, way="instant") == [1.0, 1.0]


def test_stop_the_world_waits_for_the_last_layer() -> None:
    """The new replica serves from 2 s: the second prompt is better off behind the first on the old one."""
    assert ttfts(TWO_AT_ZERO, Copy(0.0, (2.0,)), speed=1000.0, way="stop_the_world") == [1.0, 2.0]
    late = [*TWO_AT_ZERO, Prompt(0.0, 1000)]
    assert ttfts(late, Copy(0.0, (2.0,)), speed=1000.0, way="stop_the_world") == [1.0, 2.0, 3.0]


def test_ideal_zigzag_relays_at_the_layer_that_ends_soonest() -> None:
    """Two layers, the first landed at 0 s, the second at 2 s. The second prompt runs layer 0 on the new
    replica (0–0.5 s) and layer 1 on the old one once it is free (1–1.5 s); the third finds the new
    replica free at 0.5 s, layer 0 until 1 s, and the old one free at 1.5 s: it ends at 2 s."""
    copy = Copy(0.0, (0.0, 2.0))
    prompts = [*TWO_AT_ZERO, Prompt(0.0, 1000)]
    assert ttfts(prompts, copy, speed=1000.0, way="ideal_zigzag") == [1.0, 1.5, 2.0]
    assert ttfts(prompts, copy, speed=1000.0, way="stop_the_world") == [1.0, 2.0, 3.0]


def test_no_layers_no_model() -> None:
    with pytest.raises(ValueError):
        ttfts(TWO_AT_ZERO, Copy(0.0, ()), speed=1000.0, way="ideal_zigzag")
