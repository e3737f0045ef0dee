"""The node end to end over `--transport ucx` (issue 7): a real `python -m engine.node` whose replicas move
KV through ucxx (its shared-memory and TCP transports, `UCX_TLS=sm,tcp`, on CPU), checked token for token
against the model run in one piece (`engine.verify.compare`), and `status` naming the transport; then
`--transport auto`, which resolves to inproc (every endpoint is in the node's process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replicas.model import Model
from tests.node.harness import node_process, wait_idle, wait_serving
from tests.node.workload import check_outcome, mixed_workload, send_all
from transport.ucx_worker import ucx_installed

CONCURRENT = 8


@pytest.mark.slow  # a node process: importing torch and loading the model take seconds
async def test_tokens_are_identical_over_ucx(
    tmp_path: Path, tiny: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not ucx_installed():
        pytest.skip("ucxx is not installed (pip install -e '.[ucx]')")
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "sm,tcp"))  # the node process inherits it
    with node_process(tmp_path, "--transport", "ucx", "--replicas", "prefill=1,decode=2") as node:
        asks = mixed_workload(tiny, CONCURRENT, text=True)
        async with node.client() as client:
            status = await wait_serving(client)
            assert {replica.transport for replica in status.replicas} == {"ucx"}
            outcomes = await send_all(client, asks)
            await wait_idle(client)
    problems = [problem for outcome in outcomes for problem in check_outcome(tiny, outcome, transport="ucx")]
    assert not problems, "\n".join(problems)
    assert sum(1 for outcome in outcomes if outcome.result.transfers) >= CONCURRENT // 2


@pytest.mark.slow
async def test_auto_resolves_to_inproc_inside_one_node(tmp_path: Path, tiny: Model) -> None:
    with node_process(tmp_path, "--transport", "auto", "--replicas", "prefill=1,decode=1") as node:
        async with node.client() as client:
            status = await wait_serving(client)
            assert {replica.transport for replica in status.replicas} == {"inproc"}
            outcomes = await send_all(client, mixed_workload(tiny, 2, text=True))
            await wait_idle(client)
    problems = [
        problem for outcome in outcomes for problem in check_outcome(tiny, outcome, transport="inproc")
    ]
    assert not problems, "\n".join(problems)
    assert "transfer.transport_chosen" in node.stderr()
