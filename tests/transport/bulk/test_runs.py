"""Run planning and the direct block-to-block copy."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transport.harness import (
    as_bytes,
    assert_same_bytes,
    embedding_layout,
    kv_layout,
    poisoned_storage,
    random_storage,
)
from transport.bulk.runs import (
    Run,
    block_index,
    checksum_runs,
    copy_runs,
    group_index,
    group_numbers,
    plan_runs,
)


def test_runs_coalesce_consecutive_block_pairs() -> None:
    assert plan_runs([3, 4, 5, 1], 2, [7, 8, 9, 0], 2, 11, 4) == [Run(14, 30, 10), Run(4, 0, 1)]


def test_out_of_range_names_the_range() -> None:
    with pytest.raises(
        ValueError, match=r"^destination token range \[3, 12\) outside its 2 blocks of 4 tokens \(8 tokens\)$"
    ):
        plan_runs([0, 1, 2], 0, [5, 6], 3, 9, 4)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 9),
    data=st.data(),
)
def test_runs_move_each_token_once_in_order(block_size: int, data: st.DataObject) -> None:
    src_ids = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True))
    dst_ids = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=8, unique=True))
    src_offset = data.draw(st.integers(0, len(src_ids) * block_size))
    dst_offset = data.draw(st.integers(0, len(dst_ids) * block_size))
    count = data.draw(
        st.integers(0, min(len(src_ids) * block_size - src_offset, len(dst_ids) * block_size - dst_offset))
    )
    runs = plan_runs(src_ids, src_offset, dst_ids, dst_offset, count, block_size)
    pairs = [(run.src_row + i, run.dst_row + i) for run in runs for i in range(run.rows)]
    expected = [
        (
            src_ids[(src_offset + t) // block_size] * block_size + (src_offset + t) % block_size,
            dst_ids[(dst_offset + t) // block_size] * block_size + (dst_offset + t) % block_size,
        )
        for t in range(count)
    ]
    assert pairs == expected
    assert len(runs) <= len(src_ids) + len(dst_ids)
    for a, b in itertools.pairwise(runs):
        assert not (a.src_row + a.rows == b.src_row and a.dst_row + a.rows == b.dst_row)


@pytest.mark.parametrize("layout", [embedding_layout(block_size=4, hidden=40000), kv_layout(block_size=4)])
def test_copy_runs_matches_gather_and_leaves_the_rest_alone(layout) -> None:
    src = random_storage(layout, 12, seed=1)
    dst = poisoned_storage(layout, 12)
    rng = random.Random(5)
    src_ids, dst_ids = rng.sample(range(12), 5), rng.sample(range(12), 5)
    runs = plan_runs(src_ids, 1, dst_ids, 3, 15, layout.block_size)
    names = [spec.name for spec in layout.buffers]
    assert copy_runs(src, dst, runs, names) == 15 * layout.bytes_per_token
    assert_same_bytes(as_bytes(dst.gather(dst_ids, 3, 15)), as_bytes(src.gather(src_ids, 1, 15)))
    landed_rows = {run.dst_row + i for run in runs for i in range(run.rows)}
    for name in names:
        flat = dst.flat(name).view(dst.num_blocks * layout.block_size, -1).view(torch.uint8)
        untouched = [row for row in range(flat.shape[0]) if row not in landed_rows]
        assert bool((flat[untouched] == 0x5A).all())
    assert checksum_runs(src, runs, names, source=True) == checksum_runs(dst, runs, names, source=False)


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 8), in_step=st.booleans(), data=st.data())
def test_a_group_index_moves_exactly_the_runs_rows(
    block_size: int, in_step: bool, data: st.DataObject
) -> None:
    """Gather and scatter by groups of rows (whole blocks when the write is in step) land what a copy
    per run would, and nothing else."""
    src_blocks, dst_blocks = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    src_ids = rng.sample(range(src_blocks + 2), src_blocks)
    dst_ids = rng.sample(range(dst_blocks + 3), dst_blocks)
    src_offset = data.draw(st.integers(0, block_size - 1))
    dst_offset = src_offset if in_step else data.draw(st.integers(0, block_size - 1))
    count = data.draw(st.integers(1, min(src_blocks, dst_blocks) * block_size - max(src_offset, dst_offset)))
    runs = plan_runs(src_ids, src_offset, dst_ids, dst_offset, count, block_size)
    source = torch.randint(-(2**31), 2**31, ((src_blocks + 2) * block_size, 3), dtype=torch.int32)
    target = torch.zeros((dst_blocks + 3) * block_size, 3, dtype=torch.int32)
    cpu = torch.device("cpu")
    index = group_index(runs, (source.shape[0], target.shape[0]), (cpu, cpu))
    index.copy(source, target)
    expected = torch.zeros_like(target)
    for run in runs:
        expected[run.dst_row : run.dst_row + run.rows] = source[run.src_row : run.src_row + run.rows]
    assert torch.equal(target, expected)
    assert len(index.src) == len(index.dst) == count // index.group
    if in_step and src_offset == 0 and count % block_size == 0:
        assert index.group % block_size == 0  # whole blocks move as one entry each


@settings(max_examples=200, deadline=None)
@given(
    stretches=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 40)), max_size=30),
    group=st.integers(1, 4),
)
def test_group_numbers_are_every_group_of_every_stretch_in_order(
    stretches: list[tuple[int, int]], group: int
) -> None:
    """Stretches of any lengths (empty ones too), in any order, overlapping or not: the group numbers
    a loop over every row would list."""
    starts = [start * group for start, _count in stretches]
    lengths = [count * group for _start, count in stretches]
    expected = [start // group + i for start, length in zip(starts, lengths) for i in range(length // group)]
    assert group_numbers(starts, lengths, group).tolist() == expected


@pytest.mark.parametrize("blocks", [1, 2, 17, 18])
def test_block_indices_on_one_device_start_16_byte_aligned(blocks: int) -> None:
    """Source and target group numbers share one upload; each starts 16-byte aligned (an odd count is
    padded), since the GPU copy's kernel would be compiled again, on the event loop, for an unaligned one."""
    src, dst = list(range(blocks)), list(range(100, 100 + blocks))
    cpu = torch.device("cpu")
    index = block_index(src, dst, 16, (cpu, cpu))
    assert index.src.tolist() == src and index.dst.tolist() == dst
    assert index.src.data_ptr() % 16 == 0 and index.dst.data_ptr() % 16 == 0
