"""Hosts on one machine: each a Linux network namespace with its own address on a shared bridge.

    with open_network(["etcd", "a", "b"]) as network:     # root, with iproute2 (see `unavailable`)
        network.address("a")                               # 10.x.y.2: a's own address
        network.command("a", ["python", "-m", "engine.node", ...])   # runs inside a's namespace
        network.cut("a"); network.restore("a")             # a's link down (both ways), then up
        network.limit("a", mbit=100)                       # tc tbf on a's link, both directions

Each host has one veth pair: one end in its namespace (its address, a /24), the other a port of a bridge
in the caller's namespace, which holds the subnet's first address — so the caller (tests, the bench's
clients) reaches every host directly, and the hosts reach each other through the bridge. `cut` sets the
bridge's end down: the host keeps its address and its sockets, but nothing passes either way (a cable
pulled at the switch: connects time out, open connections go silent). `limit` shapes both directions
with a token bucket filter (`tc qdisc … tbf`; netem, which would add delay, is not assumed).

Names are unique per network (`zzh-<pid>-<tag>-<host>` namespaces; interfaces `zh<tag>…`, which fit
Linux's 15 characters): tests that run side by side (pytest-xdist) do not meet. The subnet is a free
10.a.b.0/24, chosen under a lock file so that two networks opening at once do not take the same one.
Leaving the block ends every process still running in a namespace (SIGKILL) and deletes the
namespaces, the veth pairs and the bridge — also when the block raised. Networks whose creating process
died without cleaning up (a CI job killed mid-test) are removed by the next `open_network`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

PREFIX: Final = "zzh"
LINK_PREFIX: Final = "zh"
LOCK_FILE: Final = Path("/tmp/zigzag-hosts.lock")
IP_SECONDS: Final = 20.0
_counter = itertools.count()
_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-z]+)-")


@final
class HostsUnavailable(Exception):
    """This machine cannot run hosts in namespaces (the message says why)."""


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can): not Linux, not root, no `ip`, or the
    kernel refused a probe namespace."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return (
            "network namespaces need root (ip netns add): run as root, or in a container with CAP_SYS_ADMIN"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command: install iproute2 (apt-get install iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe-{next(_counter)}"
    try:
        _ip("netns", "add", probe)
    except HostsUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    _ip_quiet("netns", "delete", probe)
    return None


@final
@dataclass(frozen=True, slots=True)
class Host:
    """One host: its namespace, its address, and the bridge's end of its link (`port`)."""

    name: str
    namespace: str
    address: str
    port: str  # the veth end on the bridge (in the caller's namespace)
    inside: str  # the veth end in the namespace


@final
class Network:
    """See the module docstring. Not thread-safe; every method runs `ip`/`tc` and waits for it."""

    def __init__(self, tag: str, bridge: str, subnet: ipaddress.IPv4Network) -> None:
        self.tag = tag
        self.bridge = bridge
        self.subnet = subnet
        self.hosts: dict[str, Host] = {}
        self.gateway = str(subnet.network_address + 1)

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` to run inside `host`'s namespace (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def add(self, name: str) -> Host:
        """A new host on the bridge, with the next address of the subnet."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts)
        namespace = f"{PREFIX}-{os.getpid()}-{self.tag}-{name}"
        port, inside = f"{LINK_PREFIX}{self.tag}p{index}", f"{LINK_PREFIX}{self.tag}i{index}"
        address = str(self.subnet.network_address + 2 + index)
        host = Host(name=name, namespace=namespace, address=address, port=port, inside=inside)
        self.hosts[name] = host  # listed first: a failure below still cleans what was made
        _ip("netns", "add", namespace)
        _ip("link", "add", port, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        return host

    def cut(self, host: str) -> None:
        """Nothing passes `host`'s link, either way, until `restore`."""
        _ip("link", "set", self.hosts[host].port, "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].port, "up")

    def limit(self, host: str, *, mbit: float, burst_kbyte: int = 64, latency_ms: int = 50) -> None:
        """Shape `host`'s link to `mbit` megabits per second each way (a token bucket filter)."""
        h = self.hosts[host]
        shape = [
            "root",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            f"{burst_kbyte}kb",
            "latency",
            f"{latency_ms}ms",
        ]
        _run(["tc", "qdisc", "replace", "dev", h.port, *shape])
        _run(["ip", "netns", "exec", h.namespace, "tc", "qdisc", "replace", "dev", h.inside, *shape])

    def unlimit(self, host: str) -> None:
        h = self.hosts[host]
        _run_quiet(["tc", "qdisc", "del", "dev", h.port, "root"])
        _run_quiet(["ip", "netns", "exec", h.namespace, "tc", "qdisc", "del", "dev", h.inside, "root"])

    def close(self) -> None:
        """End the processes left in the namespaces, delete the namespaces, links and the bridge."""
        for host in self.hosts.values():
            _remove_namespace(host.namespace)
            _ip_quiet("link", "delete", host.port)  # gone with its namespace's end, usually
        _ip_quiet("link", "delete", self.bridge)


@contextlib.contextmanager
def open_network(hosts: Sequence[str]) -> Iterator[Network]:
    """A bridge and one namespace per name of `hosts` (see the module docstring); raises
    `HostsUnavailable` when they cannot be made."""
    reason = unavailable()
    if reason is not None:
        raise HostsUnavailable(reason)
    _reap_orphans()
    tag = _tag()
    bridge = f"{LINK_PREFIX}{tag}br"
    with _locked():
        subnet = _free_subnet()
        network = Network(tag, bridge, subnet)
        try:
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{network.gateway}/{subnet.prefixlen}", "dev", bridge)
            _ip("link", "set", bridge, "up")
        except BaseException:
            network.close()
            raise
    try:
        for name in hosts:
            network.add(name)
        yield network
    finally:
        network.close()


def _tag() -> str:
    """A short name part unique among this machine's live networks: the pid and a counter, in base 36."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    value = os.getpid() * 36 + next(_counter) % 36
    text = ""
    while value:
        value, rest = divmod(value, 36)
        text = digits[rest] + text
    return text[-6:]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with LOCK_FILE.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.a.b.0/24 that no address or route of this namespace overlaps (called under the lock)."""
    used = []
    listing = _run(["ip", "-4", "-o", "addr", "show"]) + _run(["ip", "-4", "route", "show"])
    for match in re.finditer(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", listing):
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(match.group(1), strict=False))
    rng = random.Random()
    for _ in range(200):
        subnet = ipaddress.IPv4Network(f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 255)}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.prefixlen > 0):
            return subnet
    raise HostsUnavailable("no free 10.x.y.0/24 subnet for a bridge")


def _reap_orphans() -> None:
    """Remove the namespaces and links of networks whose creating process is gone."""
    dead_tags = set()
    for line in _run_quiet(["ip", "netns", "list"]).splitlines():
        namespace = line.split()[0] if line.split() else ""
        match = _NAMESPACE.match(namespace)
        if match and not _alive(int(match.group(1))):
            dead_tags.add(match.group(2))
            _remove_namespace(namespace)
    for line in _run_quiet(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        if name.startswith(LINK_PREFIX) and name.endswith("br") and name[2:-2] in dead_tags:
            _ip_quiet("link", "delete", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(namespace: str) -> None:
    for pid in _run_quiet(["ip", "netns", "pids", namespace]).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip_quiet("netns", "delete", namespace)


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _ip_quiet(*args: str) -> None:
    _run_quiet(["ip", *args])


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostsUnavailable(f"{' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        raise HostsUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done.stdout


def _run_quiet(argv: list[str]) -> str:
    """`argv`'s output, or "" when it fails (cleanup: what is already gone is fine)."""
    try:
        return _run(argv)
    except HostsUnavailable:
        return ""
