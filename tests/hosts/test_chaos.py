"""Chaos on separate hosts: four nodes (prefill on hosts a and b, decode on c and d, etcd on its own
host), clients under load, and a seeded schedule of faults — a partition longer than the lease TTL,
a node killed with SIGKILL and started again with the same --node-id, etcd killed and restarted, the
leader killed and started again. Then: every request ended, with the model's tokens or an error code
(or, for a node that was cut off or killed while the client spoke to it, a connection that failed);
every node serves again after the last fault; no replica holds a block; every node lists every node.

`python -m engine.bench chaos --seconds N` runs the same for longer and prints the counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.chaos.load import CONNECT_S, LoadShape, Record
from engine.chaos.run import ChaosConfig, ChaosReport, run_chaos
from replicas.model import tiny_model
from tests.hosts.conftest import require_hosts
from tests.node.workload import Ask, Outcome, check_outcome

SEED = 46
CONFIG = ChaosConfig(
    seed=SEED,
    seconds=50.0,
    period_s=9.0,
    partition_s=5.0,
    lease_ttl=3,
    clients=4,
    kinds=("partition", "kill", "etcd", "leader"),
    shape=LoadShape(prompt_tokens=(10, 120), max_tokens=(8, 40)),
)


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_the_cluster_heals_after_partitions_kills_and_an_etcd_restart(tmp_path: Path) -> None:
    require_hosts()
    report = await run_chaos(tmp_path, CONFIG)
    summary = "\n".join(report.summary()) + f"\nlogs: {report.log_dir}"
    print(summary)
    outcomes = report.outcomes()
    assert outcomes["result"] > 0, summary
    assert outcomes["no_end"] == 0, summary
    assert len(report.faults) == len(CONFIG.kinds or ()), summary

    # Every error has a code a client can act on, and says what happened.
    errors = [r for r in report.records if r.outcome == "error"]
    assert all(r.code not in (None, "internal", "shutting_down") and r.message for r in errors), [
        (r.code, r.message) for r in errors
    ]
    # A connection fails only to a node that was cut off, killed or restarting then.
    unexplained = [
        r for r in report.records if r.outcome in ("unreachable", "connection_lost") and not _hit(report, r)
    ]
    assert not unexplained, [(r.node, r.outcome, r.message, r.started - report.started) for r in unexplained]

    # Every result is the model's, run in one piece (tokens, stream, one KV transfer of the whole prompt).
    model = tiny_model()
    problems = [
        problem
        for record in report.records
        if record.result is not None
        for problem in check_outcome(
            model,
            Outcome(
                Ask(input_ids=tuple(record.prompt), max_tokens=record.max_tokens, stream=record.stream),
                record.result,
                record.streamed,
            ),
            transport="tcp",
        )
    ]
    assert not problems, "\n".join(problems[:10])

    # Healed: every node served again after the last fault and after the load; nothing held or queued.
    assert report.time_to_serve_s is not None, summary
    assert set(report.serves_after.values()) == {"ok"}, summary
    assert sum(report.blocks_held.values()) == 0 and sum(report.queued.values()) == 0, summary
    assert all(sorted(nodes) == sorted(report.serve_again_s) for nodes in report.members.values()), (
        report.members
    )


def _hit(report: ChaosReport, record: Record) -> bool:
    """Whether a fault hit `record`'s node (or its host, or etcd) while the client tried it."""
    host = next(spec.host for spec in report.config.layout if spec.node_id == record.node)
    for run in report.faults:
        start = report.started + run.started_s - CONNECT_S
        end = report.started + run.ended_s + CONNECT_S
        if record.started <= end and record.ended >= start and run.target in (record.node, host):
            return True
    return False
