"""The planner on a real node, driven by an injected load (not timing luck): a burst adds a prefill
replica — through ZigZag with `blitz`, stop-the-world with `serverless` — and when the load falls the
replica goes through ShuttingPrefill and ShuttingNull to Inactive after the keep-alive. No decision while a
scale runs. Requests served meanwhile give the model's tokens.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from engine.client import ControlClient
from engine.logs.aggregate import Aggregator
from engine.logs.reader import read_entries
from engine.logs.timeline import Timeline, build_timeline
from engine.planner.loop import Signals
from engine.planner.signals import Rates
from replicas.model import tiny_model
from tests.epd.inprocess import ServedNode, served_node
from tests.node.harness import wait_status
from tests.node.workload import check_outcome, mixed_workload, send
from tests.waiting import wait_until

BURST = Signals(20_000, Rates(arriving_tokens_per_s=5_000.0, prefill_tokens_per_s=2_000.0), 0, 64, {})
CALM = Signals(0, Rates(prefill_tokens_per_s=2_000.0), 0, 64, {})
OPTIONS = (
    "--replicas",
    "prefill=1,decode=1",
    "--autoscale",
    "--autoscale-period",
    "0.05",
    "--autoscale-keep-alive",
    "0.3",
    "--max-prefill-replicas",
    "2",
    "--autoscale-down-after",
    "0.5",
)


def _timeline(served: ServedNode) -> Timeline:
    entries, _ = read_entries([served.log_file])
    aggregator = Aggregator()
    for entry in entries:
        aggregator.add(entry.event)
    return build_timeline(aggregator)


def _decisions(served: ServedNode, action: str) -> list[dict[str, Any]]:
    return [e for e in served.events("planner_decision") if e["action"] == action]


def _states(served: ServedNode, replica: str) -> list[str]:
    return [e["to"] for e in served.events("replica_state") if e["replica"] == replica]


@pytest.mark.parametrize("policy", ["blitz", "serverless"])
async def test_a_burst_adds_a_prefill_replica_and_the_calm_removes_it(tmp_path: Path, policy: str) -> None:
    model = tiny_model()
    async with served_node(tmp_path, *OPTIONS, "--autoscale-policy", policy) as served:
        planner = served.node.planner
        assert planner is not None
        async with ControlClient.connect(served.address) as client:
            await wait_status(
                client, lambda s: all(r.state in ("Prefill", "Decode") for r in s.replicas), "serving"
            )
            planner.inject(BURST)
            await wait_status(
                client,
                lambda s: sum(r.role == "prefill" and r.state == "Prefill" for r in s.replicas) == 2,
                "a second prefill replica serving",
            )
            up = _decisions(served, "scale_up")
            assert up[0]["role"] == "prefill" and up[0]["current"] == 1 and up[0]["target"] == 2
            assert up[0]["inputs"]["waiting_tokens"] == 20_000 and up[0]["low"] == 11 and up[0]["high"] == 15
            paired = served.events("replicas_paired")
            assert (len(paired) == 1) == (policy == "blitz"), paired  # ZigZag only with blitz
            outcome = await send(client, mixed_workload(model, 1, text=False)[0])
            assert not check_outcome(model, outcome, transport="inproc")

            planner.inject(CALM)
            released = await wait_until(
                lambda: [n for n in ("prefill-0", "prefill-1") if "Inactive" in _states(served, n)],
                "a prefill replica released after the keep-alive",
                30,
            )
            assert _states(served, released[0])[-3:] == ["ShuttingPrefill", "ShuttingNull", "Inactive"]
            # `python -m engine.logs timeline` shows the replica count per role over time
            prefill = [point.prefill for point in _timeline(served).counts]
            assert max(prefill) == 2 and prefill[-1] == 1, prefill
            down = _decisions(served, "scale_down")
            waited = [
                d for d in _decisions(served, "keep") if d["reason"] == "below range for less than 0.5 s"
            ]
            assert (
                waited and waited[0]["ts"] < down[0]["ts"]
            )  # the scale-down waited for the range to stay low
            assert down[0]["role"] == "prefill" and (down[0]["current"], down[0]["target"]) == (2, 1)
            assert _decisions(served, "release")


async def test_no_decision_while_a_scale_runs(tmp_path: Path) -> None:
    async with served_node(tmp_path, *OPTIONS) as served:
        planner = served.node.planner
        assert planner is not None
        async with served.node.core.scale_lock:  # as a scale holds it while it runs
            planner.inject(BURST)
            await wait_until(lambda: _decisions(served, "skip"), "a skipped pass", 30)
            assert {d["reason"] for d in _decisions(served, "skip")} == {"a scale is running"}
            assert not _decisions(served, "scale_up")
            assert sum(r.role == "prefill" for r in served.node.directory.local()) == 1
        planner.inject(CALM)


async def test_first_tokens_past_the_ttft_slo_add_a_prefill_replica(tmp_path: Path) -> None:
    """The band alone asks for one replica; a window in which half the first tokens missed the SLO asks
    for one more."""
    within_band = Signals(0, Rates(prefill_tokens_per_s=2_000.0, slo_miss_fraction=0.5), 0, 64, {})
    async with served_node(
        tmp_path, *OPTIONS, "--autoscale-slo-ttft", "0.3", "--autoscale-window", "0.2"
    ) as served:
        planner = served.node.planner
        assert planner is not None
        async with ControlClient.connect(served.address) as client:
            await wait_status(
                client, lambda s: all(r.state in ("Prefill", "Decode") for r in s.replicas), "serving"
            )
            planner.inject(within_band)
            await wait_status(
                client,
                lambda s: sum(r.role == "prefill" and r.state == "Prefill" for r in s.replicas) == 2,
                "a second prefill replica serving",
            )
            up = _decisions(served, "scale_up")[0]
            assert (up["current"], up["target"], up["low"]) == (1, 2, 2)
            assert up["inputs"]["slo_miss_fraction"] == 0.5
            planner.inject(CALM)


async def test_a_pass_that_changes_nothing_is_logged_once_a_second(tmp_path: Path) -> None:
    """Passes run every 0.05 s; a `keep` repeating the role's last one word for word waits a second."""
    async with served_node(tmp_path, *OPTIONS) as served:
        planner = served.node.planner
        assert planner is not None
        planner.inject(CALM)

        def repeated() -> list[dict[str, Any]]:
            keeps = [d for d in _decisions(served, "keep") if d["role"] == "decode"]
            return [d for d in keeps if d["reason"] == keeps[-1]["reason"]] if keeps else []

        same = await wait_until(lambda: len(repeated()) >= 3 and repeated(), "three equal keeps", 30)
        said = {(d["current"], d["target"], d["low"], d["high"], d["reason"]) for d in same}
        assert len(said) == 1, said
        gaps = [b["ts"] - a["ts"] for a, b in pairwise(same)]
        assert all(gap > 0.9 for gap in gaps), gaps  # 20 passes a second, one line


async def test_the_band_sized_by_queueing_adds_a_replica_utilisation_would_not(tmp_path: Path) -> None:
    """10 prompts/s of 100 tokens at 2,000 tokens/s a replica: utilisation 0.5, within the band; but one
    replica's predicted 0.9-quantile wait (0.08 s) plus the prompt (0.05 s) passes a TTFT SLO of 0.07 s,
    so the band's low end is two (engine/planner/queueing.py, worked in tests/planner/test_queueing.py)."""
    rates = Rates(arriving_tokens_per_s=1_000.0, arriving_requests_per_s=10.0, prefill_tokens_per_s=2_000.0)
    async with served_node(
        tmp_path, *OPTIONS, "--autoscale-slo-ttft", "0.07", "--autoscale-slo-ttft-per-token", "0"
    ) as served:
        planner = served.node.planner
        assert planner is not None
        async with ControlClient.connect(served.address) as client:
            await wait_status(
                client, lambda s: all(r.state in ("Prefill", "Decode") for r in s.replicas), "serving"
            )
            planner.inject(Signals(0, rates, 0, 64, {}))
            await wait_until(lambda: _decisions(served, "scale_up"), "a prefill scale-up", 30)
            up = _decisions(served, "scale_up")[0]
            assert (up["role"], up["current"], up["target"], up["low"]) == ("prefill", 1, 2, 2)
            assert up["inputs"]["slo_miss_fraction"] == 0.0  # the band asked, not the SLO rule
            assert up["inputs"]["arriving_requests_per_s"] == 10.0
            planner.inject(CALM)
