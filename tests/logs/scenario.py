"""A realistic node log, written through the real `engine.logging` writer, and what it should summarise to.

`write_scenario(path, ...)` plays a node's life on a virtual clock: replicas load, requests (text and
image) go through encode, a multi-round embedding transfer, prefill, a KV transfer and decode; decode-1 is
locked and unlocked, shut down and revived; prefill-1 mutates into a decode replica; one request fails on a
transfer timeout, one is cancelled; a client sends a bad line; the controller reports blocks and flows.
It returns `Expected`: the counts the test sent, to compare with the analysis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from engine.config import NodeConfig
from engine.logging import EventLog, open_event_log
from messages.control import ReplicaStateName
from messages.log.events import (
    BlocksReport,
    ClientConnected,
    ClientDisconnected,
    ControlBadLine,
    EncodeFinished,
    EncodeStarted,
    FirstToken,
    Flow,
    FlowReport,
    NodeConfigured,
    NodeStarted,
    NodeStopped,
    NodeStopping,
    PrefillFinished,
    PrefillStarted,
    ReplicaBlocks,
    ReplicaLocked,
    ReplicaStateChanged,
    ReplicaUnlocked,
    RequestArrived,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestQueued,
    Transfer,
    TransferFinished,
    TransferRound,
    TransferStarted,
)

START_TS = 1_790_000_000.0
REPLICAS = ("encode-0", "prefill-0", "prefill-1", "decode-0", "decode-1")
EMBED_BLOCK_TOKENS = 4
EMBED_ROW_BYTES = 128 * 4
KV_TOKEN_BYTES = 4 * 2 * 2 * 32 * 4


@dataclass
class Expected:
    """What the scenario emitted."""

    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    rounds: dict[str, Counter[int]] = field(default_factory=lambda: {"embedding": Counter(), "kv": Counter()})
    transfer_bytes: dict[str, int] = field(default_factory=lambda: {"embedding": 0, "kv": 0})
    failed_transfers: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    states: dict[str, list[str]] = field(default_factory=dict)
    locked: set[str] = field(default_factory=set)
    flows: Counter[tuple[str, str]] = field(default_factory=Counter)
    request_ids: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    end_ts: float = 0.0


class _Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def tick(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class _Node:
    """Emits one node's events at virtual times and keeps `Expected` up to date."""

    def __init__(self, log: EventLog, clock: _Clock, expected: Expected, prefix: str) -> None:
        self.prefix = prefix
        self.log = log
        self.clock = clock
        self.expected = expected
        self.transfers = 0

    def state(self, replica: str, before: ReplicaStateName, after: ReplicaStateName, trigger: str) -> None:
        self.log.emit(
            ReplicaStateChanged(
                ts=self.clock.tick(0.002),
                replica=replica,
                from_state=before,
                to_state=after,
                trigger="command" if trigger == "command" else "automatic",
                reason=trigger,
            )
        )
        self.expected.states.setdefault(replica, [before]).append(after)

    def transfer(
        self,
        request_log: EventLog,
        kind: Transfer,
        source: str,
        destination: str,
        tokens: int,
        per_round: int,
        *,
        fail_after: int | None = None,
        both_sides_finish: bool = False,
    ) -> None:
        self.transfers += 1
        transfer_id = f"{self.prefix}-{kind}-{self.transfers}"
        token_bytes = EMBED_ROW_BYTES if kind == "embedding" else KV_TOKEN_BYTES
        common = {"kind": kind, "transfer_id": transfer_id, "source": source, "destination": destination}
        request_log.emit(
            TransferStarted(
                ts=self.clock.tick(0.0005),
                replica=destination,
                transport="inproc",
                total_tokens=tokens if kind == "kv" else None,
                granted_blocks=1,
                **common,
            )
        )
        offset = rounds = moved = 0
        started = self.clock.now
        while offset < tokens and (fail_after is None or rounds < fail_after):
            chunk = min(per_round, tokens - offset)
            request_log.emit(
                TransferRound(
                    ts=self.clock.tick(0.001),
                    replica=source,
                    transport="inproc",
                    round=rounds,
                    offset=offset,
                    tokens=chunk,
                    total_tokens=tokens,
                    bytes=chunk * token_bytes,
                    **common,
                )
            )
            offset += chunk
            rounds += 1
            moved += chunk * token_bytes
        failed = fail_after is not None
        sides = (destination, source) if both_sides_finish else (destination,)
        for side in sides:
            request_log.emit(
                TransferFinished(
                    ts=self.clock.tick(0.0002),
                    replica=side,
                    transport="inproc",
                    status="failed" if failed else "success",
                    reason="no progress for 30.0 s" if failed else None,
                    rounds=rounds,
                    tokens=offset,
                    bytes=moved,
                    seconds=self.clock.now - started,
                    **common,
                )
            )
        self.expected.rounds[kind][rounds] += 1
        self.expected.transfer_bytes[kind] += moved
        if moved:
            self.expected.flows[(source, destination)] += moved
        self.expected.failed_transfers += failed

    def request(
        self,
        request_id: str,
        *,
        prefill: str = "prefill-0",
        decode: str = "decode-0",
        image_tokens: int = 0,
        output_tokens: int = 4,
        outcome: str = "length",
        cached_tokens: int = 0,
    ) -> None:
        expected = self.expected
        expected.requests += 1
        expected.request_ids.append(request_id)
        log = self.log.bind(request_id=request_id)
        tick = self.clock.tick
        prompt = 12 + image_tokens
        log.emit(
            RequestArrived(
                ts=tick(0.003),
                connection="c1",
                prompt_tokens=None,
                images=int(image_tokens > 0),
                max_tokens=4,
                stream=True,
            )
        )
        if image_tokens:
            log.emit(RequestQueued(ts=tick(0.001), queue="work", position=0))  # the router: no replica
            encode = log.bind(replica="encode-0")
            encode.emit(EncodeStarted(ts=tick(0.002), images=1))
            encode.emit(EncodeFinished(ts=tick(0.006), tokens=image_tokens, seconds=0.006))
            self.transfer(
                log,
                "embedding",
                "encode-0",
                prefill,
                image_tokens,
                EMBED_BLOCK_TOKENS,
                both_sides_finish=True,
            )
        log.emit(RequestQueued(ts=tick(0.001), queue="work", position=0))
        language = log.bind(replica=prefill)
        language.emit(
            PrefillStarted(ts=tick(0.001), tokens=prompt, batch_size=1, cached_tokens=cached_tokens)
        )
        language.emit(PrefillFinished(ts=tick(0.010), tokens=prompt, seconds=0.010))
        language.emit(FirstToken(ts=tick(0.0005), token_id=42, ttft_s=0.0))
        if outcome == "failed":
            self.transfer(log, "kv", prefill, decode, prompt, 1024, fail_after=0)
            log.emit(  # the node ends requests: no replica
                RequestFailed(ts=tick(0.001), code="transfer_timeout", message="kv transfer timed out")
            )
            expected.outcomes["failed"] += 1
            expected.errors["transfer_timeout"] += 1
            return
        self.transfer(log, "kv", prefill, decode, prompt, 1024)
        generating = log.bind(replica=decode)
        generating.emit(RequestQueued(ts=tick(0.0005), queue="migration", position=0))
        produced = output_tokens
        if outcome == "cancelled":
            produced = 2
            log.emit(RequestCancelled(ts=tick(0.004), reason="cancel_op", output_tokens=produced))
        finish_ts = tick(0.004 * produced)
        log.emit(
            RequestFinished(
                ts=finish_ts,
                finish_reason="cancelled" if outcome == "cancelled" else "length",
                prompt_tokens=prompt,
                output_tokens=produced,
                e2e_s=0.0,
                ttft_s=None,
                tpot_s=None,
            )
        )
        expected.outcomes[outcome] += 1
        expected.generated_tokens += produced


def write_scenario(path: Path, *, start_ts: float = START_TS, prefix: str = "r") -> Expected:
    """Write the scenario's log to `path` (appending) and return what it holds."""
    expected = Expected()
    clock = _Clock(start_ts)
    log = open_event_log(file=str(path), level="debug", console=None)
    node = _Node(log, clock, expected, prefix)
    log.emit(
        NodeStarted(
            ts=clock.now,
            listen="127.0.0.1:7340",
            model="tiny",
            device="cpu",
            transport="inproc",
            replicas=list(REPLICAS),
            pid=4242,
            version="0.1.0",
        )
    )
    log.emit(NodeConfigured(ts=clock.tick(0.001), config=msgspec.to_builtins(NodeConfig())))
    loading: dict[str, tuple[ReplicaStateName, ReplicaStateName]] = {
        "encode": ("LoadingEncode", "Encode"),
        "prefill": ("LoadingPrefill", "Prefill"),
        "decode": ("LoadingDecode", "Decode"),
    }
    for replica in REPLICAS:
        node.state(replica, "Inactive", loading[replica.split("-")[0]][0], "command")
    for replica in REPLICAS:
        node.state(replica, *loading[replica.split("-")[0]], "automatic")
    log.emit(ClientConnected(ts=clock.tick(0.01), connection="c1", peer="127.0.0.1:50000"))

    node.request(f"{prefix}1")
    node.request(f"{prefix}2", image_tokens=10)  # 3 embedding rounds of 4 tokens
    node.request(f"{prefix}3", decode="decode-1", image_tokens=16)  # 4 rounds
    log.emit(
        ReplicaLocked(
            ts=clock.tick(0.001), replica="decode-1", reason="manual", used_blocks=3, total_blocks=64
        )
    )
    expected.locked.add("decode-1")
    node.request(f"{prefix}4", prefill="prefill-1")
    log.emit(ReplicaUnlocked(ts=clock.tick(0.02), replica="decode-1", reason="manual", still_locked=False))
    node.request(f"{prefix}5", outcome="cancelled", cached_tokens=8)  # two 4-token blocks of the cache
    node.request(f"{prefix}6", outcome="failed")
    log.emit(
        ControlBadLine(
            ts=clock.tick(0.001),
            connection="c1",
            peer="127.0.0.1:50000",
            id=None,
            message="the line is not valid JSON",
        )
    )
    expected.errors["bad_request"] += 1
    log.emit(
        BlocksReport(
            ts=clock.tick(0.001),
            replicas=[
                ReplicaBlocks(
                    replica=name,
                    state=expected.states[name][-1],
                    used_blocks=0,
                    cached_blocks=0,
                    total_blocks=64,
                    locked=not name.startswith("decode"),
                    prefix_blocks=5 if name == "prefill-0" else 0,
                    prefix_evicted=2 if name == "prefill-0" else 0,
                )
                for name in REPLICAS
            ],
        )
    )
    log.emit(
        FlowReport(
            ts=clock.tick(0.001),
            interval_s=1.0,
            flows=[
                Flow(source=source, destination=destination, kind="kv", bytes=count)
                for (source, destination), count in sorted(expected.flows.items())
                if source.startswith("prefill")
            ],
        )
    )
    node.state("decode-1", "Decode", "ShuttingDecode", "command")
    node.state("decode-1", "ShuttingDecode", "ShuttingNull", "automatic")
    node.request(f"{prefix}7", image_tokens=4)  # one round
    node.state("decode-1", "ShuttingNull", "AusDecode", "command")
    node.state("decode-1", "AusDecode", "Decode", "automatic")
    node.state("prefill-1", "Prefill", "MutatingToDecode", "command")
    node.state("prefill-1", "MutatingToDecode", "Decode", "automatic")
    node.request(f"{prefix}8", decode="prefill-1")
    log.emit(
        ClientDisconnected(
            ts=clock.tick(0.01), connection="c1", peer="127.0.0.1:50000", reason="eof", cancelled_requests=0
        )
    )
    log.emit(NodeStopping(ts=clock.tick(0.001), reason="shutdown_op", detail="shutdown op", in_flight=0))
    log.emit(NodeStopped(ts=clock.tick(0.01), exit_code=0, leaked_blocks=0, uptime_s=clock.now - start_ts))
    expected.end_ts = clock.now
    log.close()
    return expected
