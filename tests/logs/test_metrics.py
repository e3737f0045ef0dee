"""The node's `metrics` reply from the same aggregation, fed live with bounded memory."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from engine.config import ControlConfig
from engine.config.address import TcpAddress
from engine.control.errors import RequestFailed as HandlerRequestFailed
from engine.control.outbox import ReplySink
from engine.control.server import ControlServer
from engine.logging import open_event_log
from engine.logs.aggregate import Aggregator
from engine.logs.metrics import metrics_result
from engine.logs.reader import read_entries
from messages.control import ControlRequest
from messages.control_replies import MetricsResult, ReplicaGauge, reply_decoder
from messages.log.events import (
    FirstToken,
    PrefillStarted,
    RequestArrived,
    RequestCancelled,
    RequestFinished,
    TransferFinished,
    TransferRound,
)
from tests.logs.scenario import START_TS, write_scenario
from tests.waiting import deadline


def _fed(path: Path, *, keep_requests: bool) -> Aggregator:
    entries, _ = read_entries([path])
    aggregator = Aggregator(keep_requests=keep_requests)
    for entry in entries:
        aggregator.add(entry.event)
    return aggregator


def test_metrics_counts_what_the_log_shows_and_is_a_valid_reply(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    expected = write_scenario(path)
    live = _fed(path, keep_requests=False)
    result = metrics_result(live, id="m1")
    # What goes on the socket decodes with the protocol's own decoder (bounds included).
    assert reply_decoder("metrics").decode(msgspec.json.encode(result)) == result
    assert result.uptime_s == pytest.approx(expected.end_ts - START_TS)
    requests = result.requests
    assert (requests.arrived, requests.finished_stop, requests.finished_length) == (8, 0, 6)
    assert (requests.cancelled, requests.failed, requests.queued, requests.running) == (1, 1, 0, 0)
    assert result.tokens.generated == expected.generated_tokens
    assert {t.kind: t.rounds for t in result.transfers} == {
        kind: dict(sorted(rounds.items())) for kind, rounds in expected.rounds.items()
    }
    assert {t.kind: (t.succeeded, t.failed, t.bytes) for t in result.transfers} == {
        "embedding": (3, 0, expected.transfer_bytes["embedding"]),
        "kv": (7, 1, expected.transfer_bytes["kv"]),
    }
    assert result.errors == dict(expected.errors)
    gauges = {gauge.name: gauge for gauge in result.replicas}
    assert gauges["decode-1"] == ReplicaGauge(
        name="decode-1", state="Decode", used_blocks=0, total_blocks=64, locked=False
    )
    assert gauges["prefill-1"].state == "Decode" and gauges["encode-0"].locked
    # Nothing ended is kept; the analyser's aggregator (which keeps everything) counts the same.
    assert live.requests == {} and live.transfers == {}
    kept = metrics_result(_fed(path, keep_requests=True), id="m1")
    assert kept == result


def test_gauges_count_requests_in_flight() -> None:
    aggregator = Aggregator(keep_requests=False)
    for rid in ("a", "b", "c"):
        aggregator.add(
            RequestArrived(
                ts=1.0,
                request_id=rid,
                connection="c1",
                prompt_tokens=None,
                images=0,
                max_tokens=4,
                stream=False,
            )
        )
    aggregator.add(PrefillStarted(ts=2.0, request_id="b", replica="prefill-0", tokens=5, batch_size=1))
    result = metrics_result(aggregator, id="m", uptime_s=7.5)
    assert (result.requests.arrived, result.requests.queued, result.requests.running) == (3, 2, 1)
    assert result.uptime_s == 7.5
    assert result.replicas == []


def test_late_duplicates_of_ended_requests_and_transfers_are_not_counted_twice() -> None:
    aggregator = Aggregator(keep_requests=False)
    common = {"request_id": "r", "kind": "kv", "transfer_id": "t", "source": "p", "destination": "d"}
    aggregator.add(
        TransferRound(
            ts=1.0,
            replica="p",
            round=0,
            offset=0,
            tokens=4,
            total_tokens=4,
            bytes=64,
            transport="tcp",
            **common,
        )  # type: ignore[arg-type]
    )
    finished = TransferFinished(
        ts=1.1,
        replica="d",
        status="success",
        reason=None,
        rounds=1,
        tokens=4,
        bytes=64,
        seconds=0.1,
        transport="tcp",
        **common,  # type: ignore[arg-type]
    )
    aggregator.add(finished)
    aggregator.add(msgspec.structs.replace(finished, replica="p", ts=1.2))  # the sender's side, later
    aggregator.add(
        TransferRound(
            ts=1.3,
            replica="d",
            round=0,
            offset=0,
            tokens=4,
            total_tokens=4,
            bytes=64,
            transport="tcp",
            **common,
        )  # type: ignore[arg-type]
    )
    aggregator.add(FirstToken(ts=1.4, request_id="r", replica="d", token_id=1, ttft_s=0.4))
    aggregator.add(RequestCancelled(ts=1.5, request_id="r", replica="d", reason="cancel_op", output_tokens=1))
    aggregator.add(
        RequestFinished(
            ts=1.6,
            request_id="r",
            replica="d",
            finish_reason="cancelled",
            prompt_tokens=4,
            output_tokens=1,
            e2e_s=0.6,
            ttft_s=0.4,
            tpot_s=None,
        )
    )
    result: MetricsResult = metrics_result(aggregator, id="m")
    assert result.requests.cancelled == 1 and result.tokens.generated == 1
    assert [(t.succeeded, t.rounds, t.bytes) for t in result.transfers] == [(1, {1: 1}, 64)]
    assert dict(aggregator.flows) == {("p", "d", "kv"): 64}
    assert aggregator.requests == {} and aggregator.transfers == {}


def _one_request(aggregator: Aggregator, start: float, output_tokens: int) -> None:
    aggregator.add(
        RequestArrived(
            ts=start, request_id="r", replica=None, connection="c1", prompt_tokens=4, images=0, max_tokens=8,
            stream=False,
        )
    )  # fmt: skip
    aggregator.add(FirstToken(ts=start + 0.1, request_id="r", replica="d", token_id=1, ttft_s=0.1))
    aggregator.add(
        RequestFinished(
            ts=start + 0.5, request_id="r", replica=None, finish_reason="length", prompt_tokens=4,
            output_tokens=output_tokens, e2e_s=0.5, ttft_s=0.1, tpot_s=0.1,
        )
    )  # fmt: skip


@pytest.mark.parametrize("keep_requests", [False, True], ids=["live", "log"])
def test_a_request_id_used_again_after_its_request_ended_is_a_new_request(keep_requests: bool) -> None:
    aggregator = Aggregator(keep_requests=keep_requests)
    _one_request(aggregator, 10.0, output_tokens=2)
    _one_request(aggregator, 20.0, output_tokens=3)
    result = metrics_result(aggregator, id="m")
    assert (result.requests.arrived, result.requests.finished_length) == (2, 2)
    assert (result.tokens.prompt, result.tokens.generated) == (8, 5)
    if keep_requests:
        assert list(aggregator.requests) == ["r#1", "r"]
        assert [r.arrived for r in aggregator.requests.values()] == [10.0, 20.0]


class _RefusingHandler:
    """Answers every request with `not_supported` (the control server is what this test is about)."""

    async def handle(self, request: ControlRequest, replies: ReplySink) -> None:
        raise HandlerRequestFailed("not_supported", f"{request.__struct_config__.tag} is not served here")


async def test_an_observer_of_the_event_log_counts_what_the_control_server_logs(tmp_path: Path) -> None:
    aggregator = Aggregator(keep_requests=False)
    log = open_event_log(
        file=str(tmp_path / "node.jsonl"), console=None, level="error", observers=[aggregator.add]
    )
    server = ControlServer(_RefusingHandler(), ControlConfig(), log)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve, TcpAddress(host="127.0.0.1", port=0))
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            await stream.send_all(b"hello\n")
            with deadline("the server's reply to a bad line", 10):
                reply = await stream.receive_some(65536)
        assert b'"code":"bad_request"' in reply
        server.close()
    log.close()
    # The observer saw the bad line and the connection although the file only takes errors.
    assert metrics_result(aggregator, id="m").errors == {"bad_request": 1}
    assert aggregator.connections == 1
    assert (tmp_path / "node.jsonl").read_bytes() == b""
