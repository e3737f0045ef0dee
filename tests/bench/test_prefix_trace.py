"""The prefix bench's trace (engine/bench/trace/prefix.py): Mooncake's format scaled to this machine, equal hash
ids giving equal token blocks, and the trace's own hit-rate bound."""

from __future__ import annotations

from pathlib import Path

from engine.bench.trace.ceiling import chained_keys, model_hit_rate
from engine.bench.trace.prefix import SLICE, bound, load
from transport.memory.blocks import BlockPool
from transport.memory.prefix_cache import PrefixCache


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


def test_the_cache_model_lru_and_beladys_rule(tmp_path: Path) -> None:
    """Two blocks of room; A, B, C (each 2 blocks), then A again: LRU has evicted A for C, Belady's rule
    kept A (needed again) and did not keep C (never needed again). Unbounded, both reach the bound."""
    trace = tmp_path / "t.jsonl"
    lines = [(1, 2), (3, 4), (5, 6), (1, 2)]
    trace.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": 1200, "output_length": 1, "hash_ids": [{a}, {b}, {100 + i}]}}\n'
            for i, (a, b) in enumerate(lines)
        )
    )
    requests = load(trace, limit=10, time_scale=1.0, block_tokens=4, output_divisor=1)
    assert [len(r.prompt) for r in requests] == [9] * 4  # two full blocks and a partial one each
    assert model_hit_rate(requests, 4, 2, "lru") == 0.0
    assert model_hit_rate(requests, 4, 2, "belady") == 2 / 12
    assert model_hit_rate(requests, 4, 100, "lru") == model_hit_rate(requests, 4, 100, "belady") == 2 / 12
    assert bound(requests)[0] == 2 / 12


def test_on_the_slice_beladys_rule_bounds_lru() -> None:
    requests = load(SLICE, limit=300, time_scale=1.0, block_tokens=16, output_divisor=16)
    for room in (1311, 2622):
        assert model_hit_rate(requests, 16, room, "lru") < model_hit_rate(requests, 16, room, "belady")
    assert model_hit_rate(requests, 16, 5244, "belady") <= bound(requests)[0]


def test_the_models_lru_is_the_prefix_cache() -> None:
    """The slice's requests one at a time through the real `PrefixCache` (keys from the model's chains,
    blocks from a pool with room for the bound and one prompt) borrow exactly what the model's LRU says."""
    requests = load(SLICE, limit=300, time_scale=1.0, block_tokens=16, output_divisor=16)
    room = 1311
    pool = BlockPool(room + max(len(r.hash_ids) for r in requests) + 1, 16)
    cache = PrefixCache(pool, max_blocks=room)
    borrowed = 0
    for index, (request, chain) in enumerate(zip(requests, chained_keys(requests, 16), strict=True)):
        owner = f"r{index}"
        keys = [key.to_bytes(8, "little") for key in chain]
        table = cache.acquire(owner, keys, limit=(len(request.prompt) - 1) // 16)
        borrowed += len(table)
        table = table + pool.allocate(-(-len(request.prompt) // 16) - len(table), owner)
        cache.publish(owner, table)
        cache.release(owner, table)
    cache.check_invariants()
    assert borrowed / sum(len(r.hash_ids) for r in requests) == model_hit_rate(requests, 16, room, "lru")
