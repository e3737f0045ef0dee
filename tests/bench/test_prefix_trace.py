"""The prefix bench's trace (engine/bench/trace/prefix.py): Mooncake's format scaled to this machine, equal hash
ids giving equal token blocks, and the trace's own hit-rate bound."""

from __future__ import annotations

from pathlib import Path

from engine.bench.trace.prefix import SLICE, bound, load


def test_equal_hash_ids_give_equal_blocks_and_the_bound_counts_repeats(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 1000, "input_length": 1000, "output_length": 64, "hash_ids": [7, 8]}\n'
        '{"timestamp": 1500, "input_length": 1536, "output_length": 3, "hash_ids": [7, 8, 9]}\n'
    )
    first, second = load(trace, limit=10, time_scale=2.0, block_tokens=4, output_divisor=16)
    assert (first.at, second.at) == (0.0, 1.0)
    assert len(first.prompt) == round(1000 * 4 / 512) == 8 and len(second.prompt) == 12
    assert second.prompt[:8] == first.prompt
    assert (first.output_tokens, second.output_tokens) == (4, 1)
    assert bound([first, second]) == (2 / 5, 3)


def test_the_vendored_slice_loads() -> None:
    requests = load(SLICE, limit=300, time_scale=1.0, block_tokens=16, output_divisor=16)
    assert len(requests) == 300
    rate, distinct = bound(requests)
    assert 0.55 < rate < 0.65 and distinct == 5244
