"""The forecast on a real node: the provisioning lead time is measured from a real weight copy and becomes
the forecast's horizon in the planner's decisions, and `--autoscale-advisory` decides and logs but
changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.client import ControlClient
from engine.planner.loop import Signals
from engine.planner.signals import Rates
from tests.epd.inprocess import ServedNode, served_node
from tests.node.harness import wait_status
from tests.waiting import wait_until

BURST = Signals(20_000, Rates(arriving_tokens_per_s=5_000.0, prefill_tokens_per_s=2_000.0), 0, 64, {})
OPTIONS = (
    "--replicas",
    "prefill=1,decode=1",
    "--autoscale",
    "--autoscale-period",
    "0.05",
    "--max-prefill-replicas",
    "2",
)


def _decisions(served: ServedNode, **fields: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in served.events("planner_decision")
        if all(e.get(name) == value for name, value in fields.items())
    ]


async def test_the_lead_time_is_measured_from_a_real_copy(tmp_path: Path) -> None:
    """A manual scale-up copies the weights from a peer (emulated at a speed that makes it take about
    0.2 s); from the copy's start until the replica serves is the peer's lead time, and the planner's
    next decisions forecast over that horizon."""
    options = (*OPTIONS, "--autoscale-advisory", "--autoscale-pause-after-manual", "0")
    options += ("--emulated-speed", "peer_gb_per_s=0.01")  # the tiny model, 2.6 MB: ~0.26 s
    async with served_node(tmp_path, *options) as served:
        lead = served.node.metrics.load.lead
        async with ControlClient.connect(served.address) as client:
            await wait_status(
                client, lambda s: all(r.state in ("Prefill", "Decode") for r in s.replicas), "serving"
            )
            assert lead.seconds("peer") is None
            await client.scale("prefill", 2, mode="stop_the_world", source="peer")
            await wait_status(
                client,
                lambda s: sum(r.role == "prefill" and r.state == "Prefill" for r in s.replicas) == 2,
                "a second prefill replica serving",
            )
        measured = await wait_until(lambda: lead.seconds("peer"), "the peer's lead time", 30)
        (started,) = [e for e in served.events("weights_copy_started") if e["sources"][0] == "peer"]
        (finished,) = [
            e for e in served.events("weights_copy_finished") if e["replica"] == started["replica"]
        ]
        serving = [
            e
            for e in served.events("replica_state")
            if e["replica"] == started["replica"] and e["to"] == "Prefill"
        ]
        assert finished["status"] == "success" and finished["seconds"] >= 0.1
        assert measured == pytest.approx(serving[0]["ts"] - started["ts"], abs=1e-6)
        assert measured >= finished["seconds"]
        after = await wait_until(
            lambda: [
                d
                for d in _decisions(served)
                if (d["forecast"] or {}).get("lead_source") == "peer" and d["ts"] > serving[0]["ts"]
            ],
            "a decision forecasting over the peer's lead time",
            30,
        )
        assert after[0]["forecast"]["horizon_s"] == pytest.approx(measured, abs=1e-3)
        assert after[0]["forecast"]["predictor"] == "kalman"


async def test_advisory_mode_decides_and_logs_but_changes_nothing(tmp_path: Path) -> None:
    """A burst makes the planner decide a scale-up, logged as advisory; no replica is added or copied
    (a scale is applied in the pass that decides it, so after the decision nothing can follow it)."""
    async with served_node(tmp_path, *OPTIONS, "--autoscale-advisory") as served:
        planner = served.node.planner
        assert planner is not None
        async with ControlClient.connect(served.address) as client:
            await wait_status(
                client, lambda s: all(r.state in ("Prefill", "Decode") for r in s.replicas), "serving"
            )
            copies = len(served.events("weights_copy_started"))
            planner.inject(BURST)
            up = await wait_until(
                lambda: _decisions(served, action="scale_up", advisory=True), "an advisory scale-up", 30
            )
            assert (up[0]["current"], up[0]["target"]) == (1, 2) and up[0]["forecast"] is not None
            status = await client.status()
            assert sum(r.role == "prefill" and r.state != "Inactive" for r in status.replicas) == 1
            assert len(served.events("weights_copy_started")) == copies
            assert not served.node.core.scale_lock.locked()
            assert not _decisions(served, advisory=False, action="scale_up")
            planner.inject(None)
