"""The hosts helper itself (`engine.hosts.network`): each host its own address and network stack, a
link that can be cut and restored, a shaped link, and nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import sys

from engine.hosts.network import open_network
from tests.hosts.conftest import require_hosts
from tests.waiting import wait_until_blocking

# A listener bound to the host's own address (which exists only inside its namespace): prints its port,
# then answers every connection with "hello" until killed.
LISTENER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hello"); c.close()
"""
CONNECT = """
import socket, sys
print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).recv(5).decode())
"""


def _hello(address: str, port: int, timeout: float) -> str:
    with socket.create_connection((address, port), timeout=timeout) as sock:
        return sock.recv(5).decode()


def _reaches(address: str, port: int) -> bool:
    try:
        return _hello(address, port, 1.0) == "hello"
    except OSError:
        return False


def test_hosts_reach_each_other_until_a_link_is_cut() -> None:
    require_hosts()
    with open_network(["x", "y"]) as network:
        x, y = network.address("x"), network.address("y")
        assert x != y and network.gateway not in (x, y)
        listener = subprocess.Popen(
            network.command("x", [sys.executable, "-c", LISTENER, x]), stdout=subprocess.PIPE, text=True
        )
        try:
            assert listener.stdout is not None
            port = int(listener.stdout.readline())
            # from another host, and from the caller's namespace (the bridge's address)
            reply = subprocess.run(
                network.command("y", [sys.executable, "-c", CONNECT, x, str(port)]),
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            assert reply.stdout.strip() == "hello"
            assert _hello(x, port, 10) == "hello"

            network.cut("x")
            assert not _reaches(x, port)
            network.restore("x")
            wait_until_blocking(
                lambda: _reaches(x, port), "x reachable again after its link was restored", 30
            )

            network.limit("x", mbit=50)
            shaped = subprocess.run(
                ["tc", "qdisc", "show", "dev", network.hosts["x"].port], capture_output=True, text=True
            ).stdout
            assert "tbf" in shaped and "50Mbit" in shaped, shaped
            assert _hello(x, port, 10) == "hello"
            network.unlimit("x")
        finally:
            listener.kill()
            listener.wait()
        namespaces = [host.namespace for host in network.hosts.values()]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(namespace in left for namespace in namespaces), left
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert network.bridge not in links and network.hosts["x"].port not in links
