"""A host on the cluster's network that never joined, trying what an attacker would (tests/hosts/
test_security.py runs it in its own namespace): `python -m tests.hosts.intruder JSON`, where JSON names
the peer address to forge frames to, the member to impersonate and its lease (both read from etcd, as
anyone on the network can), the transfer endpoints to dial, and TLS files of a CA the cluster does not
trust. It prints one JSON line per attempt: `{"attempt": ..., "outcome": "closed" | "open" | ...}` —
"closed": the node closed the connection without serving it; "open": it still listened after
`WAIT_SECONDS` (it took the bytes as a frame of a member)."""

from __future__ import annotations

import json
import socket
import ssl
import struct
import sys
from typing import Any, Final

import msgspec

from messages.cluster import CancelForward, ClientOp, PeerFrame, PeerMessage, Report, RunCommand
from messages.commands import Lock
from messages.control import GenerateRequest, ShutdownRequest
from messages.layout import BufferSpec, PoolLayout
from messages.peer_codec import encode_peer
from messages.transfer import PROTOCOL_VERSION, Hello
from transport.links.tcp.frames import control_header

WAIT_SECONDS: Final = 5.0
FORGED: Final[dict[str, PeerMessage]] = {
    "shutdown": ClientOp(correlation="dec:1", request=ShutdownRequest(id="1", cluster=True)),
    "generate": ClientOp(
        correlation="dec:2", request=GenerateRequest(id="2", input_ids=[1, 2, 3], max_tokens=4)
    ),
    "cancel": CancelForward(request_id="any"),
    "lock": RunCommand(
        correlation="dec:3", replica="pre/prefill-0", command=Lock(command_id="c", reason="manual")
    ),
    "report": Report(accepting=False, replicas=[], endpoints={}, pid=1),
}


def _outcome(sock: socket.socket | ssl.SSLSocket) -> str:
    """ "closed" when the far side closes (or resets) within `WAIT_SECONDS`, else "open"."""
    sock.settimeout(WAIT_SECONDS)
    try:
        for _ in iter(lambda: sock.recv(65536), b""):  # whatever it sends until it closes
            continue
    except TimeoutError:
        return "open"
    except (OSError, ssl.SSLError):
        pass
    return "closed"


def _dial(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=WAIT_SECONDS)


def attempts(plan: dict[str, Any]) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for name, message in FORGED.items():
        body = msgspec.msgpack.encode(
            PeerFrame(sender=plan["impersonate"], lease=plan["lease"], message=message)
        )
        with _dial(plan["peer"]) as sock:
            sock.sendall(struct.pack(">I", len(body)) + body)
            outcomes[f"forged_{name}"] = _outcome(sock)
    with _dial(plan["peer"]) as sock:
        sock.sendall(struct.pack(">I", 600 * 1024 * 1024) + b"\0" * 4096)  # announces a 600 MiB frame
        outcomes["oversized_frame"] = _outcome(sock)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=plan["ca_file"])
    context.check_hostname = False
    context.load_cert_chain(plan["cert_file"], plan["key_file"])
    with _dial(plan["peer"]) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                outcomes["foreign_certificate"] = _outcome(tls)
        except (OSError, ssl.SSLError) as exc:
            outcomes["foreign_certificate"] = f"closed ({type(exc).__name__})"
    layout = PoolLayout(block_size=16, buffers=(BufferSpec(name="k0", shape=(1,), dtype="float32"),))
    for address in plan["transfers"]:
        hello = encode_peer(
            Hello(link_id="x", protocol_version=PROTOCOL_VERSION, endpoint="x/kv", layout=layout, address="")
        )
        with _dial(address) as sock:
            sock.sendall(control_header(len(hello)) + hello)
            outcomes[f"transfer_{address}"] = _outcome(sock)
    return outcomes


if __name__ == "__main__":
    for attempt, outcome in attempts(json.loads(sys.argv[1])).items():
        print(json.dumps({"attempt": attempt, "outcome": outcome}), flush=True)
