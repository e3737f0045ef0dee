"""The `zigzag` benchmark's peer copy across hosts (`--only copy --hosts 2`): a replica's own copy of the
weights from a replica of another node, each node on its own host — a network namespace with its own
address on a bridge (`engine.hosts`) — against raw TCP moving the same bytes between the same two hosts.

Two nodes, `--transport tcp`: `src` on host a serves the model (`--replicas prefill=1`), `cap` on host b
joins holding none (`--replicas prefill=0,decode=0`). For each of `--copy-repeats` rounds (after one that
warms both sides up): `scale prefill 1 node=cap source=peer` (sent to src), wait until cap's replica
serves, read bytes and seconds from its `weights_copy_finished` event, then scale cap back to 0 and send
the parked replica to `Inactive`, so the next round copies again. Right after each copy: a sender on host
a and a receiver on host b (plain Python sockets, `sendall` of one buffer, `recv_into` a preallocated
one) move the same number of bytes; its seconds run from the receiver's connect to its last byte.

With `--hosts 3` the copy rows still take two hosts (only two take part in a copy from one source); a
machine that does not allow namespaces (no root, no `ip`) stops the benchmark, saying why. GB/s per copy,
the median over the rounds. Goal: ≥ 0.8 of the raw path.

`--only ttft --hosts 3` (`burst_hosts_run`, rows made by `engine.bench.zigzag`): the burst on three
hosts — `pre` serving prefill on host a, `dec` decode on host b, `cap` on host c holding nothing — with
the new prefill replica scaled onto `cap` (its weights from a peer on another host). ZigZag there pairs a
NewPrefill on `cap` with `pre`'s OldPrefill across nodes, `pre`'s router sending the NewPrefill prompts
from `cap`'s reports, its KV halves into `dec`; where the ZigZag scale onto `cap` is refused all the same
(`bad_request`), both ways run the "within" layout (`LAYOUTS`) and the row says so.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import trio

from engine.bench.nodes import read_events
from engine.bench.rows import Row, row
from engine.bench.zigzag.copy import copy_checkpoint
from messages.control import ScaleMode

if TYPE_CHECKING:
    from engine.client import ControlClient
    from engine.hosts.network import Network

BENCH: Final = "zigzag"
STATE_SECONDS: Final = 120.0
# The raw path: a receiver on one host prints its port, takes one connection and reads N bytes into a
# preallocated buffer; it prints the seconds from the connection's accept to the last byte.
RECEIVER: Final = """
import socket, sys, time
n = int(sys.argv[2]); buf = bytearray(n); view = memoryview(buf)
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); started = time.perf_counter(); got = 0
while got < n:
    k = c.recv_into(view[got:], min(n - got, 1 << 22))
    if not k: raise SystemExit("connection closed early")
    got += k
print(time.perf_counter() - started, flush=True)
"""
SENDER: Final = """
import socket, sys
n = int(sys.argv[3]); data = bytes(n)
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as c: c.sendall(data)
"""


def host_copy_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    from engine.hosts.network import unavailable

    if args.hosts < 2:
        raise SystemExit("--hosts: the copy rows across hosts take 2 hosts (one source, one new node)")
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--hosts needs hosts in network namespaces: {reason}")
    with copy_checkpoint(args.copy_model, directory) as (model, _, options):
        project, baseline, nbytes = trio.run(_measure, args, directory, options)
    note = (
        f"uncapped; model {model}, {nbytes} bytes per copy, two nodes on two hosts (network namespaces on "
        "a bridge, --transport tcp), measured through the new node (weights_copy_finished bytes / "
        f"seconds); the raw path: Python sockets between the same hosts; median of {len(project)}; "
        "goal >= 0.8"
    )
    case = "weights_copy_peer_hosts" + ("" if model == "tiny" else f"_{model}")
    yield row(BENCH, case, "GB/s", "higher", statistics.median(project), statistics.median(baseline),
              "raw TCP between the two hosts, the same bytes", unit="GB/s", note=note)  # fmt: skip


async def _measure(
    args: argparse.Namespace, directory: Path, options: list[str]
) -> tuple[list[float], list[float], int]:
    from engine.client import ControlClient
    from engine.hosts.cluster import NodeSpec, open_host_cluster

    specs = [NodeSpec("src", "a", "prefill=1,decode=0"), NodeSpec("cap", "b", "prefill=0,decode=0")]
    directory = directory / "copy-hosts"  # etcd's data and the nodes' logs, apart from another cluster's
    project: list[float] = []
    baseline: list[float] = []
    nbytes = 0
    async with open_host_cluster(directory, specs, options=["--transport", "tcp", *options]) as cluster:
        src, cap = cluster.nodes["src"].address, cluster.nodes["cap"].address
        assert src is not None and cap is not None
        log_file = cluster.nodes["cap"].log_files[-1]
        token = cluster.token
        async with ControlClient.connect(cap, token=token) as there:  # cap has src's report: its replica
            await _wait_state(there, "src/prefill-0", "Prefill")
        async with ControlClient.connect(src, token=token) as client:
            for attempt in range(args.copy_repeats + 1):  # the first round warms both sides up
                seconds, copied = await _copy(client, log_file, cap, token)
                raw = await trio.to_thread.run_sync(_raw, cluster.network, copied)
                if attempt:
                    project.append(copied / seconds / 1e9)
                    baseline.append(copied / raw / 1e9)
                    nbytes = copied
    return project, baseline, nbytes


async def _copy(client: ControlClient, log_file: Path, cap: str, token: bytes) -> tuple[float, int]:
    """One copy into cap's replica from src's (its seconds and bytes), then that replica parked again."""
    from engine.client import ControlClient

    before = len(read_events(log_file, "weights_copy_finished"))
    result = await client.scale("prefill", 1, mode="stop_the_world", source="peer", node="cap")
    (started,) = result.started
    with trio.fail_after(STATE_SECONDS):
        while len(finished := read_events(log_file, "weights_copy_finished")) <= before:  # noqa: ASYNC110
            await trio.sleep(0.02)
    event = finished[-1]
    if event["status"] != "success":
        raise RuntimeError(f"the weight copy into {started.replica} did not succeed: {event}")
    async with ControlClient.connect(cap, token=token) as there:
        await _wait_state(there, started.replica, "Prefill")
        await there.scale("prefill", 0)
        await _wait_state(there, started.replica, "ShuttingNull")
        await there.transition(started.replica, "Inactive")
        await _wait_state(there, started.replica, "Inactive")
    return float(event["seconds"]), int(event["bytes"])


async def _wait_state(client: ControlClient, replica: str, state: str) -> None:
    with trio.fail_after(STATE_SECONDS):
        while True:
            status = await client.status()
            if any(r.name == replica and r.state == state for r in status.replicas):
                return
            await trio.sleep(0.02)


def _raw(network: Network, nbytes: int) -> float:
    """Seconds raw TCP takes to move `nbytes` from host a to host b."""
    receiver = subprocess.Popen(
        network.command("b", [sys.executable, "-c", RECEIVER, network.address("b"), str(nbytes)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        subprocess.run(
            network.command("a", [sys.executable, "-c", SENDER, network.address("b"), port, str(nbytes)]),
            check=True,
            timeout=STATE_SECONDS,
        )
        return float(receiver.stdout.readline())
    finally:
        receiver.kill()
        receiver.wait()


# ------------------------------------------------------------------------------------ the multicast chain
CHAIN: Final = 3


def host_chain_rows(args: argparse.Namespace, directory: Path) -> Iterator[Row]:
    """`--only chain --hosts 2`: `CHAIN` replicas on cap loaded by one `scale` from src's replica across
    src's link shaped to `--chain-mbit` (`tc tbf`, each way) — a multicast chain: only the first copy
    crosses the link, the others read the replica before them on cap — against one replica loaded the
    same way; spans as `engine.bench.zigzag.copy.chain_rows` takes them. Goal: ≤ 1.3."""
    from engine.hosts.network import unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--hosts needs hosts in network namespaces: {reason}")
    with copy_checkpoint(args.copy_model, directory) as (model, _, options):
        chains, ones = trio.run(_host_chains, args, directory, options)
    note = (
        f"two nodes on two hosts (network namespaces), --transport tcp, src's link shaped to "
        f"{args.chain_mbit:g} Mbit/s; model {model}; k = {CHAIN} replicas on the other host started by "
        f"one `scale` from src's replica (a chain) against one; median of {len(chains)}; goal <= 1.3"
    )
    case = f"weights_chain_{CHAIN}_hosts" + ("" if model == "tiny" else f"_{model}")
    yield row(BENCH, case, "seconds", "lower", statistics.median(chains), statistics.median(ones),
              "loading one replica from the same peer", unit="s", note=note)  # fmt: skip


async def _host_chains(
    args: argparse.Namespace, directory: Path, options: list[str]
) -> tuple[list[float], list[float]]:
    from engine.client import ControlClient
    from engine.hosts.cluster import NodeSpec, open_host_cluster

    specs = [NodeSpec("src", "a", "prefill=1,decode=0"), NodeSpec("cap", "b", "prefill=0,decode=0")]
    directory = directory / "chain-hosts"
    chains: list[float] = []
    ones: list[float] = []
    async with open_host_cluster(directory, specs, options=["--transport", "tcp", *options]) as cluster:
        cap = cluster.nodes["cap"].address
        assert cap is not None
        log_file = cluster.nodes["cap"].log_files[-1]
        await cluster.limit("a", mbit=args.chain_mbit)
        async with ControlClient.connect(cap, token=cluster.token) as client:
            await _wait_state(client, "src/prefill-0", "Prefill")
            for attempt in range(args.copy_repeats + 1):
                for k, into in ((1, ones), (CHAIN, chains)):
                    seconds = await _load_k(client, log_file, k)
                    if attempt:
                        into.append(seconds)
    return chains, ones


async def _load_k(client: ControlClient, log_file: Path, k: int) -> float:
    """Scale cap's prefill replicas from 0 to k from a peer, wait, scale back, park them `Inactive`; the
    span from the first copy's start to the last one's end."""
    before = len(read_events(log_file, "weights_copy_started"))
    result = await client.scale("prefill", k, mode="stop_the_world", source="peer")
    new = [started.replica for started in result.started]
    with trio.fail_after(STATE_SECONDS):
        while len(finished := read_events(log_file, "weights_copy_finished")) < before + k:  # noqa: ASYNC110
            await trio.sleep(0.02)
    ours, started = finished[before:], read_events(log_file, "weights_copy_started")[before:]
    if any(event["status"] != "success" for event in ours):
        raise RuntimeError(f"a weight copy did not succeed: {ours}")
    span = max(e["ts"] for e in ours) - min(e["ts"] for e in started)
    for name in new:
        await _wait_state(client, name, "Prefill")
    await client.scale("prefill", 0)
    for name in new:
        await _wait_state(client, name, "ShuttingNull")
        await client.transition(name, "Inactive")
        await _wait_state(client, name, "Inactive")
    return span


# ------------------------------------------------------------------------------- the burst on three hosts
# `--only ttft --hosts 3`, two layouts of three hosts. "cross": node `pre` serves prefill on host a,
# `dec` decode on host b, `cap` on host c holds nothing (`--replicas prefill=0,decode=0`), and the scale
# places the new prefill replica on `cap` — a ZigZag pair across nodes, its KV halves into `dec`.
# "within" (where the ZigZag scale onto `cap` is refused): `pre` serves prefill and decode, and the scale
# places the new replica on `pre`, paired there; `dec` and the empty `cap` serve as in "cross".
LAYOUTS: Final = {
    "cross": (
        ("pre", "a", "prefill=1,decode=0"),
        ("dec", "b", "prefill=0,decode=1"),
        ("cap", "c", "prefill=0,decode=0"),
    ),
    "within": (
        ("pre", "a", "prefill=1,decode=1"),
        ("dec", "b", "prefill=0,decode=1"),
        ("cap", "c", "prefill=0,decode=0"),
    ),
}
SCALED: Final = {"cross": "cap", "within": "pre"}  # the node the scale places the new replica on
# One request's outcome: (arrival s, TTFT s or None, the layer it was relayed after or None, error code or None).
Outcome = tuple[float, float | None, int | None, str | None]


@final
class PairingRefused(Exception):
    """The ZigZag scale onto the empty node was refused (`bad_request`); the message is the node's."""


def burst_hosts_run(
    trace: Sequence[tuple[float, list[int]]],
    mode: ScaleMode,
    layout: str,
    options: Sequence[str],
    directory: Path,
    args: argparse.Namespace,
) -> tuple[list[Outcome], list[str]]:
    """One run of the burst on three hosts: a fresh cluster (`LAYOUTS[layout]`, `--transport tcp`, the
    nodes' `options`), the trace sent to `pre` (its router places each request on the cluster's
    replicas), and at `--burst-at` `scale prefill +1` onto `SCALED[layout]` with `mode` and source
    `peer`. Returns every request's outcome and the pairs the scale formed (`new <- old`, from the
    node's `replicas_paired` events). Raises `PairingRefused` when ZigZag onto the empty node is
    refused."""
    from engine.hosts.network import unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--hosts needs hosts in network namespaces: {reason}")
    return trio.run(_burst, trace, mode, layout, options, directory, args)


async def _burst(
    trace: Sequence[tuple[float, list[int]]],
    mode: ScaleMode,
    layout: str,
    options: Sequence[str],
    directory: Path,
    args: argparse.Namespace,
) -> tuple[list[Outcome], list[str]]:
    from engine.client import ControlClient, ControlError
    from engine.hosts.cluster import NodeSpec, open_host_cluster

    specs = [NodeSpec(*spec) for spec in LAYOUTS[layout]]
    node = SCALED[layout]
    outcomes: list[Outcome] = []
    refused: list[str] = []
    async with open_host_cluster(directory, specs, options=["--transport", "tcp", *options]) as cluster:
        pre = cluster.nodes["pre"].address
        assert pre is not None
        async with ControlClient.connect(pre, token=cluster.token) as client:
            await _wait_state(client, "pre/prefill-0", "Prefill")
            await _wait_state(client, "dec/decode-0", "Decode")
            for _, prompt in trace[:2]:  # warm-up, unrecorded
                await client.generate_result(input_ids=prompt, max_tokens=args.max_tokens, ignore_eos=True)
            started = trio.current_time() + 0.1
            serving = 1 if node == "pre" else 0

            async def scale() -> None:
                await trio.sleep_until(started + args.burst_at)
                try:
                    await client.scale("prefill", serving + 1, mode=mode, source="peer", node=node)
                except ControlError as exc:
                    if exc.code == "bad_request" and mode == "zigzag" and layout == "cross":
                        refused.append(exc.message)
                        nursery.cancel_scope.cancel()
                        return
                    raise

            async def one(at: float, prompt: list[int]) -> None:
                await trio.sleep_until(started + at)
                try:
                    result = await client.generate_result(
                        input_ids=prompt, max_tokens=args.max_tokens, ignore_eos=True
                    )
                except ControlError as exc:
                    outcomes.append((at, None, None, exc.code))
                    return
                layer = None if result.relay is None else result.relay.layer
                outcomes.append((at, result.timings.ttft_s, layer, None))

            with trio.fail_after(args.duration + STATE_SECONDS):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(scale)
                    for at, prompt in trace:
                        nursery.start_soon(one, at, prompt)
        if refused:
            raise PairingRefused(refused[0])
        paired = read_events(cluster.nodes[node].log_files[-1], "replicas_paired")
    return outcomes, [f"{e['new_prefill']} <- {e['old_prefill']}" for e in paired]
