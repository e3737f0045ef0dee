"""`--emulated-speed`: parsing and the emulated durations; a NewPrefill's room (`replicas.zigzag.limits`)."""

from __future__ import annotations

import pytest

from replicas.emulation import EmulatedSpeed, parse_emulated_speed
from replicas.zigzag.limits import prompt_room


def test_parse_each_key_optional() -> None:
    speed = parse_emulated_speed("prefill_tokens_per_s=2000, weights_gb_per_s=0.5")
    assert speed == EmulatedSpeed(prefill_tokens_per_s=2000.0, weights_gb_per_s=0.5)
    assert speed.decode_seconds() is None
    assert speed.prefill_seconds(1000, 2, 4) == pytest.approx(0.25)
    assert [speed.copy_seconds(10**9, source) for source in ("peer", "host", "disk")] == [2.0, 2.0, 2.0]
    assert parse_emulated_speed("") == EmulatedSpeed()


def test_each_weight_source_may_copy_at_its_own_speed() -> None:
    speed = parse_emulated_speed("weights_gb_per_s=1,peer_gb_per_s=8,disk_gb_per_s=0.25")
    assert [speed.copy_gb_per_s(source) for source in ("peer", "host", "disk")] == [8.0, 1.0, 0.25]
    assert speed.copy_seconds(2 * 10**9, "disk") == pytest.approx(8.0)
    assert EmulatedSpeed(host_gb_per_s=2.0).copy_seconds(10**9, "peer") is None


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


def test_a_new_prefill_takes_prompts_while_it_has_spare_compute() -> None:
    """Its room: a batch less the queued tokens and less each held batch weighted by the share of the
    loaded layers it has yet to run; batches at the loaded layers cost nothing."""
    room = prompt_room
    assert room(budget=512, loaded=0, queued_tokens=100, batches=[(512, 0), (512, -1)]) == 412
    assert room(budget=512, loaded=2, queued_tokens=0, batches=[(512, 2), (512, 2)]) == 512
    assert room(budget=512, loaded=2, queued_tokens=0, batches=[(300, 1), (100, -1)]) == 512 - 150 - 100
    assert room(budget=512, loaded=4, queued_tokens=64, batches=[(512, 1)]) == 512 - 64 - 384
    assert room(budget=512, loaded=3, queued_tokens=0, batches=[(1, 2)]) == 511  # a partial token counts
    assert room(budget=512, loaded=4, queued_tokens=200, batches=[(512, 0)]) < 0  # behind: takes none
