"""`--emulated-speed`: parsing and the emulated durations."""

from __future__ import annotations

import pytest

from replicas.emulation import EmulatedSpeed, parse_emulated_speed
from replicas.zigzag.limits import batch_limit


def test_parse_each_key_optional() -> None:
    speed = parse_emulated_speed("prefill_tokens_per_s=2000, weights_gb_per_s=0.5")
    assert speed == EmulatedSpeed(prefill_tokens_per_s=2000.0, weights_gb_per_s=0.5)
    assert speed.decode_seconds() is None
    assert speed.prefill_seconds(1000, 2, 4) == pytest.approx(0.25)
    assert speed.copy_seconds(10**9) == pytest.approx(2.0)
    assert parse_emulated_speed("") == EmulatedSpeed()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("speed=1", r"'speed=1' is not KEY=VALUE with KEY one of prefill_tokens_per_s, decode_steps_per_s"),
        ("decode_steps_per_s=fast", r"decode_steps_per_s must be a number, got 'fast'"),
        ("decode_steps_per_s=0", r"decode_steps_per_s must be > 0, got 0"),
    ],
)
def test_parse_refuses_naming_the_part(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_emulated_speed(text)


def test_new_prefill_batch_limit_decays() -> None:
    assert [batch_limit(t) for t in (0.0, 0.19, 0.2, 0.39, 0.4, 10.0)] == [4, 4, 3, 3, 2, 2]
