"""The node end to end over `--transport ucx`: a real `python -m engine.node` whose replicas move
KV through ucxx (its shared-memory and TCP transports, `UCX_TLS=sm,tcp`, on CPU), checked token for token
against the model run in one piece (`engine.verify.compare`), and `status` naming the transport; then
`--transport auto`, which resolves to inproc (every endpoint is in the node's process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.client import ControlError
from replicas.model import Model
from tests.node.harness import by_name, node_process, wait_idle, wait_serving, wait_status
from tests.node.workload import check_outcome, mixed_workload, send_all
from transport.links.ucx.library import ucx_installed

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
    chosen = [e["fields"] for e in node.events("diagnostic") if e["name"] == "transfer.transport_chosen"]
    assert chosen and all(
        fields == {"requested": "auto", "transport": "inproc", "reason": "both endpoints are in this process"}
        for fields in chosen
    ), chosen


@pytest.mark.slow
async def test_a_migration_the_decode_side_gave_up_on_returns_the_prefill_blocks_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`drop_link` tears prefill-0's end of its UCX link down mid-transfer without a word, as a peer
    that went silent; decode-0's end still looks alive until its link timeout (5 s), so the next
    migration's grant goes nowhere and decode-0 fails that request. prefill-0, waiting for the grant,
    must stop then and return the prompt's KV blocks: it held them until its progress timeout (30 s),
    and a shutdown in that window found them leaked (exit code 1)."""
    if not ucx_installed():
        pytest.skip("ucxx is not installed (pip install -e '.[ucx]')")
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "sm,tcp"))
    drop = "drop_link:source=prefill-0,destination=decode-0,after_bytes=100000"
    options = ("--transport", "ucx", "--replicas", "prefill=1,decode=1", "--fault", drop)
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            await client.generate_result(prompt="short", max_tokens=2)  # ~14 KB of KV: the link stays
            errors = []
            for prompt in ("a prompt long enough to cross the drop " * 4, "and one more"):
                with pytest.raises(ControlError) as failed:
                    await client.generate_result(prompt=prompt, max_tokens=2)
                errors.append((failed.value.code, failed.value.message))
            assert [code for code, _message in errors] == ["transfer_failed", "transfer_failed"]
            assert errors[0][1].endswith("dropped by fault injection after 100000 bytes")
            # decode-0's end of the link fails the next transfer after 5 s: it heard nothing more (or no
            # AbortAck for the dropped one), whichever its clock reaches first.
            assert "failed (link_lost): " in errors[1][1]
            await wait_status(
                client,
                lambda status: by_name(status)["prefill-0"].used_blocks == 0,
                "prefill-0's KV blocks back once decode-0 failed the request",
                timeout=10.0,  # a third of the 30 s the sender waited before
            )
