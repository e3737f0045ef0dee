"""`python -m engine.node --demo --nodes N`: the demo across N node processes of one cluster.

`run_cluster_demo` starts etcd (`engine.cluster.local_etcd`) in a temporary directory and N−1 child
nodes (`local_cluster`: `python -m engine.node --cluster URL --node-id node-K ...`, each read up to its
`{"listening": ...}` stdout line within `START_SECONDS`), then runs this process as node-0 of the same
cluster with the demo workload (`engine.demo.run_demo`). The demo waits until every node's replicas
serve (`wait_serving`), sends its requests to node-0's socket — the cluster routes them across the
processes — prints one line per node (`node_lines`) and ends with `shutdown {"cluster": true}`
(`shutdown_cluster`): the children stop first, then node-0.

Roles (`role_plan`): node-0 decodes; with a model that has a vision encoder node-1 encodes and node-2
prefills (with two nodes node-1 does both); without one node-1 prefills. Every further node runs one
decode or prefill replica, whichever role has fewer so far (decode on a tie). The children serve the
parent's model, device, dtype, block sizes and transport (`tcp` unless the parent asked for `tcp` or
`ucx`); the parent's `--replicas` is not used. With `--log-file run.jsonl` every node writes its own
event log beside it (`run.node-0.jsonl`, `run.node-1.jsonl`, …: `node_log_file`).

Cleanup is shielded and bounded: children still running `STOP_SECONDS` after the cluster was asked to
stop — or at once, when the run failed before asking — are ended (SIGTERM first when they were not
asked, SIGKILL after), then etcd stops. The exit code is non-zero when the demo failed, or a child did
not start or exited with a non-zero code. `local_cluster` also serves the benchmarks
(`engine.bench.e2e.cluster`), where every node is a child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final, TextIO, final

import msgspec
import trio

from engine.client.cluster import ClusterDemoFailed
from engine.cluster.certificates import Authority, make_ca, make_certificate
from engine.cluster.etcd import EtcdTls
from engine.cluster.local_etcd import (
    NO_ETCD,
    LocalEtcdAuth,
    LocalEtcdError,
    LocalEtcdTls,
    find_etcd,
    new_auth,
    start_local_etcd,
)
from engine.config import ClusterConfig, NodeConfig, ReplicaCounts
from engine.control.listening import listening_address

START_SECONDS: Final = 60.0  # a child: interpreter, imports, joining the cluster, binding its socket
STOP_SECONDS: Final = 30.0  # children asked to stop: drain, leak check, exit
KILL_SECONDS: Final = 10.0  # a child sent SIGTERM or SIGKILL: until it is reaped
_TAIL_CHARS: Final = 3000


def role_plan(nodes: int, *, vision: bool) -> list[ReplicaCounts]:
    """The replicas of node-0 … node-{nodes−1} (see the module docstring)."""
    if nodes < 2:
        raise ValueError(f"a cluster of node processes needs 2 nodes or more, not {nodes}")
    plan: list[dict[str, int]] = [{"decode": 1}]
    if nodes == 2 or not vision:
        plan.append({"encode": int(vision), "prefill": 1})
    else:
        plan += [{"encode": 1}, {"prefill": 1}]
    for _ in range(len(plan), nodes):
        decode = sum(counts.get("decode", 0) for counts in plan)
        prefill = sum(counts.get("prefill", 0) for counts in plan)
        plan.append({"decode": 1} if decode <= prefill else {"prefill": 1})
    return [ReplicaCounts(**counts) for counts in plan]


@final
class ChildNode:
    """A node process of `local_cluster`: its `node_id`, `counts`, and control `address` once it listens."""

    def __init__(self, node_id: str, counts: ReplicaCounts, process: trio.Process, stderr_path: Path) -> None:
        self.node_id = node_id
        self.counts = counts
        self.process = process
        self.stderr_path = stderr_path
        self.address: str | None = None

    def stderr_tail(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-_TAIL_CHARS:]
        except OSError as error:
            return f"(cannot read {self.stderr_path}: {error})"

    async def read_listening(self) -> str:
        """The control address of the child's `{"listening": ...}` line; `ClusterDemoFailed` when the
        child exits first or prints none within `START_SECONDS`."""
        stdout = self.process.stdout
        assert stdout is not None
        with trio.move_on_after(START_SECONDS):
            address = await listening_address(stdout)
            if address is not None:
                return address
            with trio.move_on_after(KILL_SECONDS):
                await self.process.wait()
            raise ClusterDemoFailed(
                f"node {self.node_id} exited (code {self.process.returncode}) before it "
                f"listened; its stderr ends:\n{self.stderr_tail()}"
            )
        raise ClusterDemoFailed(
            f"node {self.node_id} did not listen within {START_SECONDS:g} s; its stderr ends:\n"
            f"{self.stderr_tail()}"
        )


@final
class LocalCluster:
    """What `local_cluster` yields: etcd's `url`, its `auth` (None without `secure`) and the `children`.
    Set `stopping` once the cluster was asked to stop (`shutdown_cluster`); after the block, `failures`
    names each child that failed."""

    def __init__(
        self,
        url: str,
        certs: Path | None = None,
        ca: Authority | None = None,
        auth: LocalEtcdAuth | None = None,
    ) -> None:
        self.url = url
        self.auth = auth
        self._certs, self._ca = certs, ca
        self.children: list[ChildNode] = []
        self.stopping = False
        self.failures: list[str] = []

    def etcd_tls(self, node_id: str) -> EtcdTls | None:
        """A client certificate of the run's CA for `node_id` (made now), or None when etcd runs
        without TLS."""
        if self._ca is None or self._certs is None:
            return None
        name = f"etcd-client-{node_id}"
        made = make_certificate(self._certs, self._ca, name, common_name=self.auth is None)
        return EtcdTls(ca_file=str(made.ca_file), cert_file=str(made.cert_file), key_file=str(made.key_file))


def etcd_tls_options(tls: EtcdTls | None) -> list[str]:
    """The node flags of an etcd client certificate (none for None)."""
    if tls is None:
        return []
    return [
        *("--etcd-ca-file", str(tls.ca_file), "--etcd-cert-file", str(tls.cert_file)),
        *("--etcd-key-file", str(tls.key_file)),
    ]


@asynccontextmanager
async def local_cluster(
    directory: Path,
    children: Sequence[tuple[str, ReplicaCounts]],
    options: Sequence[str],
    *,
    log_file: str | None = None,
    secure: bool = False,
) -> AsyncIterator[LocalCluster]:
    """Start etcd (data in `directory/etcd`) and one child node per `(node_id, counts)`, with `options`
    added to each command line — and, with `log_file`, each its own event log (`node_log_file`); yield
    once every child listens. With `secure`, etcd serves https and takes only clients with a certificate
    of a CA made for the run in `directory/certs` (`engine.cluster.certificates`), and requires a user and
    password as well (`engine.cluster.local_etcd.new_auth`: a user that reads and writes only `/zigzag/`,
    its password made for the run); each child gets its own certificate (`LocalCluster.etcd_tls` makes one
    for another node), `--etcd-username` and, in its environment, `ZIGZAG_ETCD_PASSWORD`. Raises
    `LocalEtcdError` when etcd does not start, `ClusterDemoFailed` when a child does not listen."""
    certs = directory / "certs"
    ca = make_ca(certs) if secure else None
    auth = new_auth("/zigzag/") if secure else None
    tls = None
    if ca is not None:
        server = make_certificate(certs, ca, "etcd", dns=["localhost"], ips=["127.0.0.1"])
        # No commonName: etcd's gateway refuses a client certificate with one once a user is required.
        operator = make_certificate(certs, ca, "operator", common_name=False)
        tls = LocalEtcdTls(
            ca_file=str(ca.cert_file),
            cert_file=str(server.cert_file),
            key_file=str(server.key_file),
            client=EtcdTls(
                ca_file=str(ca.cert_file), cert_file=str(operator.cert_file), key_file=str(operator.key_file)
            ),
        )
    etcd = await start_local_etcd(str(directory / "etcd"), tls=tls, auth=auth)
    cluster = LocalCluster(etcd.url, certs, ca, auth)
    env: dict[str, str] = {}
    if auth is not None:
        options = [*options, "--etcd-username", auth.user]
        env["ZIGZAG_ETCD_PASSWORD"] = auth.password  # never on a command line
    try:
        try:
            for node_id, counts in children:
                logged = [] if log_file is None else ["--log-file", node_log_file(log_file, node_id)]
                logged += etcd_tls_options(cluster.etcd_tls(node_id))
                child = await _start_child(directory, etcd.url, node_id, counts, [*options, *logged], env)
                cluster.children.append(child)
            for child in cluster.children:
                child.address = await child.read_listening()
            yield cluster
        finally:
            cluster.failures = await _stop_children(cluster.children, asked=cluster.stopping)
    finally:
        await etcd.stop()


def node_log_file(log_file: str, node_id: str) -> str:
    """The event log of node `node_id` in a demo given `--log-file log_file`: `run.jsonl` →
    `run.node-1.jsonl` (`python -m engine.logs summary run.node-*.jsonl` reads them together)."""
    path = Path(log_file)
    return str(path.with_name(f"{path.stem}.{node_id}{path.suffix}"))


async def _start_child(
    directory: Path,
    url: str,
    node_id: str,
    counts: ReplicaCounts,
    options: Sequence[str],
    env: dict[str, str],
) -> ChildNode:
    command = [
        *(sys.executable, "-m", "engine.node", "--cluster", url, "--node-id", node_id),
        *("--listen", "127.0.0.1:0", "--http", "off", "--replicas", str(counts)),
        *("--no-demo", *options),
    ]
    stderr_path = directory / f"{node_id}.stderr"
    with stderr_path.open("wb") as stderr:  # a local file, handed to the child
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=os.environ | env
        )
    return ChildNode(node_id, counts, process, stderr_path)


async def _stop_children(children: list[ChildNode], *, asked: bool) -> list[str]:
    """Reap every child (shielded, bounded); what went wrong with each, in words."""
    failures = []
    with trio.CancelScope(shield=True):
        if not asked:
            for child in children:
                if child.process.returncode is None:
                    child.process.terminate()
        with trio.move_on_after(STOP_SECONDS):
            for child in children:
                await child.process.wait()
        for child in children:
            process = child.process
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(KILL_SECONDS):
                    await process.wait()
                failures.append(f"node {child.node_id} did not exit within {STOP_SECONDS:g} s; killed")
            elif process.returncode != 0:
                failures.append(
                    f"node {child.node_id} exited with code {process.returncode}; its stderr ends:\n"
                    f"{child.stderr_tail()}"
                )
            if process.stdout is not None:
                await process.stdout.aclose()
    return failures


# ---------------------------------------------------------------------------------------------- demo
def cluster_options(config: NodeConfig, transport: str) -> list[str]:
    """What the children take from the parent's config: all that a cluster's nodes must share."""
    options = [
        *("--model", config.model, "--model-cache", config.model_cache, "--device", config.device),
        *("--transport", transport, "--log-level", config.log.level),
        *("--kv-block-size", str(config.kv.block_size)),
        *("--embedding-block-size", str(config.embedding.block_size)),
        *("--cluster-name", config.cluster.cluster_name, "--cluster-host", config.cluster.cluster_host),
        *("--lease-ttl", str(config.cluster.lease_ttl)),
        *("--attention", config.executor.attention, "--cuda-graphs", config.executor.cuda_graphs),
    ]
    if config.executor.batch_invariant:
        options.append("--batch-invariant")
    if config.dtype is not None:
        options += ["--dtype", config.dtype]
    if config.max_model_len is not None:  # the KV pools sized alike
        options += ["--max-model-len", str(config.max_model_len)]
    return options


def _has_vision(config: NodeConfig) -> bool:
    from replicas.weights import ModelHost

    host = ModelHost(
        config.model, device=config.device, dtype=config.compute_dtype, cache_dir=config.model_cache
    )
    return host.config.image_token_id is not None


async def run_cluster_demo(
    config: NodeConfig, run_node: Callable[[NodeConfig], Awaitable[int]], *, out: TextIO | None = None
) -> int:
    """The demo across `config.cluster.nodes` processes (see the module docstring); `run_node` runs this
    process's node-0 with the demo and returns its exit code."""
    out = out or sys.stdout
    if find_etcd() is None:  # before anything starts: the node's one line (exit 2) says how to get it
        raise LocalEtcdError(NO_ETCD)
    transport = config.transport if config.transport in ("tcp", "ucx") else "tcp"
    plan = role_plan(config.cluster.nodes, vision=_has_vision(config))
    children = [(f"node-{index}", counts) for index, counts in enumerate(plan) if index > 0]
    log_file = config.log.file
    options = cluster_options(config, transport)
    code = 1
    cluster: LocalCluster | None = None
    with tempfile.TemporaryDirectory(prefix="zigzag-demo-") as directory:
        try:
            secure = config.cluster.secure
            async with local_cluster(
                Path(directory), children, options, log_file=log_file, secure=secure
            ) as cluster:
                kind = " (TLS and users; clients need a certificate of the run's CA and a password)"
                kind = kind if secure else ""
                print(f"demo: local etcd at {cluster.url}{kind}", file=out)
                for child in cluster.children:
                    print(
                        f"demo: started {child.node_id} (pid {child.process.pid}; {child.counts}), "
                        f"listening on {child.address}",
                        file=out,
                    )
                own_log = None if log_file is None else node_log_file(log_file, "node-0")
                parent = msgspec.structs.replace(
                    config,
                    transport=transport,
                    replicas=plan[0],
                    cluster=_with_etcd_auth(
                        _with_etcd_tls(
                            msgspec.structs.replace(config.cluster, cluster=cluster.url, node_id="node-0"),
                            cluster.etcd_tls("node-0"),
                        ),
                        cluster.auth,
                    ),
                    log=msgspec.structs.replace(config.log, file=own_log),
                )
                code = await run_node(parent)
                cluster.stopping = True
        except* (ClusterDemoFailed, LocalEtcdError) as group:
            for error in _leaves(group):
                print(f"demo: {error}", file=out)
    if cluster is not None:
        for failure in cluster.failures:
            print(f"demo: {failure}", file=out)
        if cluster.failures:
            code = code or 1
        elif cluster.stopping:
            names = ", ".join(child.node_id for child in cluster.children)
            print(f"demo: child nodes exited with code 0: {names}", file=out)
    return code


def _with_etcd_tls(config: ClusterConfig, tls: EtcdTls | None) -> ClusterConfig:
    if tls is None:
        return config
    return msgspec.structs.replace(
        config, etcd_ca_file=tls.ca_file, etcd_cert_file=tls.cert_file, etcd_key_file=tls.key_file
    )


def _with_etcd_auth(config: ClusterConfig, auth: LocalEtcdAuth | None) -> ClusterConfig:
    if auth is None:
        return config
    return msgspec.structs.replace(config, etcd_username=auth.user, etcd_password=auth.password)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for error in group.exceptions:
        leaves += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return leaves
