"""KV pool sizing by `--gpu-memory-utilization` (`engine.kv_sizing`): the arithmetic's invariants on any
numbers, a worked example, the refusal when one maximum-context sequence does not fit, and the node's
wiring — the device's `(free, total)` bytes given at the boundary (no GPU here), the rest real: the
tiny model's layouts, the node's settings, and the pools the replicas build from them, whose bytes must
fit the budget. On a cpu node the flag is accepted and does not apply; out-of-range values are refused
at parse time."""

from __future__ import annotations

import math
from typing import TypedDict

import msgspec
import pytest
import structlog.testing
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ConfigError, parse_node_config
from engine.core import NodeCore, replica_settings
from engine.kv_sizing import KvBudgetError, device_kv_settings, kv_budget
from engine.logging import open_event_log
from replicas.actor.pools import EncodePools, LanguagePools
from replicas.model import TINY_CONFIG
from tests.waiting import deadline

GIB = 1 << 30
MIB = 1 << 20

totals = st.integers(min_value=1, max_value=1 << 40)
utilizations = st.floats(min_value=0.0, max_value=1.0, exclude_min=True)


class Device(TypedDict):
    """`kv_budget`'s arguments but the utilization."""

    total: int
    free: int
    kv_replicas: int
    block_bytes: int
    fixed: int
    reserved: int
    min_blocks: int
    max_blocks: int


@st.composite
def devices(draw: st.DrawFn) -> Device:
    """A device and the pools to size on it (utilization left to the test)."""
    total = draw(totals)
    return {
        "total": total,
        "free": draw(st.integers(min_value=0, max_value=total)),
        "kv_replicas": draw(st.integers(min_value=1, max_value=64)),
        "block_bytes": draw(st.integers(min_value=1, max_value=64 * MIB)),
        "fixed": draw(st.integers(min_value=0, max_value=GIB)),
        "reserved": draw(st.integers(min_value=0, max_value=GIB)),
        "min_blocks": draw(st.integers(min_value=1, max_value=1 << 16)),
        "max_blocks": draw(st.sampled_from([1 << 16, 1 << 24])),
    }


@settings(max_examples=400, deadline=None)
@given(devices(), utilizations)
def test_the_pools_never_exceed_the_budget_and_take_all_of_it_they_can(
    device: Device, utilization: float
) -> None:
    budget = math.floor(device["total"] * utilization) - (device["total"] - device["free"])
    try:
        sized = kv_budget(utilization=utilization, **device)
    except KvBudgetError as error:
        assert str(error).startswith("kv_budget_too_small: ")
        # Refused only when one maximum-context sequence per replica does not fit.
        needed = device["kv_replicas"] * (device["min_blocks"] * device["block_bytes"] + device["fixed"])
        assert needed + device["reserved"] > budget
        return
    blocks, replicas = sized.blocks, device["kv_replicas"]
    assert device["min_blocks"] <= blocks <= device["max_blocks"]
    used = replicas * (blocks * device["block_bytes"] + device["fixed"]) + device["reserved"]
    assert used <= budget == sized.budget + device["reserved"]
    if blocks < device["max_blocks"]:  # one more block each would not fit
        assert used + replicas * device["block_bytes"] > budget


@settings(max_examples=300, deadline=None)
@given(devices(), utilizations, utilizations)
def test_more_utilization_never_gives_fewer_blocks(device: Device, one: float, other: float) -> None:
    low, high = sorted((one, other))
    try:
        more = kv_budget(utilization=high, **device).blocks
    except KvBudgetError:
        with pytest.raises(KvBudgetError):
            kv_budget(utilization=low, **device)
        return
    try:
        fewer = kv_budget(utilization=low, **device).blocks
    except KvBudgetError:
        return
    assert fewer <= more


def test_a_worked_example() -> None:
    """80 GiB, 2 GiB in use, 0.9: 72 GiB allowed, 70 GiB left; two replicas of 35 GiB less 64 MiB of
    other pools each, 16 MiB reserved: (35 GiB - 8 MiB - 64 MiB) // 1 MiB = 35,768 blocks each."""
    sized = kv_budget(
        free=78 * GIB,
        total=80 * GIB,
        utilization=0.9,
        kv_replicas=2,
        block_bytes=MIB,
        fixed=64 * MIB,
        reserved=16 * MIB,
        min_blocks=256,
    )
    assert sized.blocks == 35 * 1024 - 8 - 64
    assert sized.in_use == 2 * GIB and sized.budget == 70 * GIB - 16 * MIB


def test_a_budget_short_of_one_sequence_is_refused_naming_the_bytes_and_the_ways_out() -> None:
    with pytest.raises(KvBudgetError) as caught:
        kv_budget(
            free=10 * GIB,
            total=80 * GIB,
            utilization=0.9,
            kv_replicas=2,
            block_bytes=MIB,
            min_blocks=2048,
            where="cuda:0",
        )
    error = caught.value
    assert isinstance(error, ConfigError) and error.code == "kv_budget_too_small"
    message = str(error)
    assert message.startswith("kv_budget_too_small: --gpu-memory-utilization 0.9 ")
    for part in (
        "72.00 GiB of cuda:0's 80.00 GiB",
        "70.00 GiB is in use",
        "leaves 2.00 GiB",
        "2048 KV blocks",
    ):
        assert part in message
    for way in ("--gpu-memory-utilization", "--replicas", "--max-model-len", "--kv-pool-blocks"):
        assert way in message.rsplit("; ", 1)[1]
    # At 0.9375 it leaves 75 - 70 = 5 GiB: 2,560 blocks each, sized, not refused.
    assert (
        kv_budget(
            free=10 * GIB, total=80 * GIB, utilization=0.9375, kv_replicas=2, block_bytes=MIB, min_blocks=2048
        ).blocks
        == 2560
    )


def _device_bytes(pools: LanguagePools | EncodePools) -> int:
    """What a replica's pools put on its device (the embedding pools stay on the CPU)."""
    storages = [pools.weights.storage]
    if isinstance(pools, LanguagePools):
        storages += [pools.kv.storage, pools.relay_storage]
    return sum(storage.nbytes for storage in storages)


@pytest.mark.parametrize("counts", ["prefill=1,decode=1", "encode=1,prefill=1,decode=2", "decode=1"])
def test_the_pools_built_from_the_sized_settings_fit_the_budget(counts: str) -> None:
    """The node's wiring: the tiny model's layouts, the node's settings for `--replicas`; only the
    device's (free, total) bytes are made up. The pools the replicas then build — KV, relay and weight
    staging on the device — fit the budget, and one more KV block each would not."""
    context = 4096
    config = parse_node_config(
        ["--replicas", counts, "--gpu-memory-utilization", "0.5", "--max-model-len", str(context)]
    )
    assert config.replicas is not None
    base = replica_settings(config, context)
    total, free = 512 * MIB, 412 * MIB
    sized_settings, sized = device_kv_settings(
        base, config, TINY_CONFIG, config.replicas, context, (free, total)
    )
    assert sized_settings.kv_pool_blocks == sized.blocks >= math.ceil(context / base.kv_block_size)
    assert msgspec.structs.replace(base, kv_pool_blocks=sized.blocks) == sized_settings  # nothing else
    language = [
        LanguagePools(f"r{i}", TINY_CONFIG, sized_settings, "cpu", landing=False)
        for i in range(config.replicas.prefill + config.replicas.decode)
    ]
    encode = [EncodePools(f"e{i}", TINY_CONFIG, sized_settings, "cpu") for i in range(config.replicas.encode)]
    assert all(pools.kv.pool.num_blocks == sized.blocks for pools in language)
    every: list[LanguagePools | EncodePools] = [*language, *encode]
    used = sum(_device_bytes(pools) for pools in every)
    budget = math.floor(total * 0.5) - (total - free)
    assert used <= budget
    block = language[0].kv.storage.nbytes // sized.blocks
    assert used + len(language) * block > budget


def test_a_device_too_small_for_one_sequence_is_refused_through_the_wiring() -> None:
    config = parse_node_config(["--replicas", "prefill=1,decode=1"])
    assert config.replicas is not None
    context = TINY_CONFIG.max_position_embeddings
    with pytest.raises(
        KvBudgetError, match=r"kv_budget_too_small: --gpu-memory-utilization 0\.9 lets the node"
    ):
        device_kv_settings(
            replica_settings(config, context), config, TINY_CONFIG, config.replicas, context, (GIB // 8, GIB)
        )


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01", "two"])
def test_out_of_range_utilization_is_refused_at_parse_time_with_the_reason(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization \(gpu_memory_utilization\): bad value"):
        parse_node_config(["--gpu-memory-utilization", value])
    assert parse_node_config(["--gpu-memory-utilization", "1"]).gpu_memory_utilization == 1.0
    assert parse_node_config([]).gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "each KV pool holds one maximum-context request"),
        (["--kv-pool-blocks", "64"], "--kv-pool-blocks sizes the KV pools (64 blocks per replica)"),
    ],
)
def test_on_cpu_the_flag_is_accepted_and_an_info_line_says_what_sizes_the_pools(
    flags: list[str], says: str
) -> None:
    config = parse_node_config(["--gpu-memory-utilization", "0.7", *flags])
    core = NodeCore(config, open_event_log(file=None, console=None))
    with structlog.testing.capture_logs() as logs:
        assert not core.kv_sizing_applies()
    assert [(line["log_level"], line["event"]) for line in logs] == [("info", "kv.pool_size")]
    assert logs[0]["detail"].startswith("--gpu-memory-utilization does not apply on cpu; ")
    assert says in logs[0]["detail"]
    expected = 64 if flags else math.ceil(core.served.context / config.kv.block_size)
    assert core.settings.kv_pool_blocks == expected


async def test_the_replicas_a_node_starts_build_the_pools_it_sized() -> None:
    """`NodeCore.size_kv_pools` with the device's numbers made up (what `start_replicas` reads from
    `torch.cuda.mem_get_info` on cuda): the replicas it then starts have KV pools of the sized blocks."""
    context = 4096
    config = parse_node_config(
        [
            "--replicas",
            "prefill=1,decode=1",
            "--max-model-len",
            str(context),
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    core = NodeCore(config, open_event_log(file=None, console=None))
    unsized = core.settings.kv_pool_blocks
    core.size_kv_pools((412 * MIB, 512 * MIB))
    blocks = core.settings.kv_pool_blocks
    assert blocks != unsized and blocks >= context // config.kv.block_size
    async with trio.open_nursery() as nursery:
        with deadline("the sized replicas started", 60):
            await core.start_replicas(nursery)
        assert [replica.snapshot().kv_blocks for replica in core.directory.local()] == [blocks, blocks]
        nursery.cancel_scope.cancel()
