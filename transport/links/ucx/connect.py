"""Making UCX links: one worker per endpoint, listening, and the connect exchange.

Each endpoint that uses UCX gets one worker (`worker_for`), progressed by a task in the endpoint's
nursery. A sending endpoint listens at `ucx://<hex of its worker address>`; with UCX's shared-memory
transports that address reaches the worker from any process on the host, and with `tcp` in `UCX_TLS`
from other hosts too.

Connecting (receiver → sender): `dial` makes a UCX endpoint from the sender's worker address and sends
`connect{its link number, its own worker address}` to the sender's listener (link number 0); the
listener makes the sending link and an endpoint back, and answers `accept{its link number, its pid, its
cross-memory probe address and host key}` (the receiver's fence for writes the sender makes into its
memory: `transport.links.ucx.peer_process`). A receiver that will read the sender's rows itself (`ucx_copies =
"cma"`, `transport.links.ucx.reads`) then says `reads`.
With the cluster secret, the two then prove it to each other (`transport.links.ucx.admission`): the
listener hands the link to its endpoint only once the receiver has.
Then the handshake of architecture §5.1 (`Hello` / `HelloAck`) runs over the link as on any transport.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable

import structlog
import trio

from transport.errors import LinkBroken, LinkClosed, LinkError
from transport.links.ucx import admission
from transport.links.ucx.cma import PROBE_ADDRESS, readable
from transport.links.ucx.frames import (
    ACCEPT,
    CONNECT,
    GOODBYE,
    UcxFrameError,
    accept_body,
    connect_body,
    kind_of,
    parse_accept,
    parse_goodbye,
    parse_number,
    reads_body,
)
from transport.links.ucx.library import UcxFailed
from transport.links.ucx.link import UcxLink
from transport.links.ucx.peer_process import host_key, local_pid
from transport.links.ucx.worker import LISTENER, Arrival, UcxWorker
from transport.protocol.link import Link, LinkOwner, Role
from transport.protocol.scope import describe_exit

_workers: weakref.WeakKeyDictionary[LinkOwner, UcxWorker] = weakref.WeakKeyDictionary()
_log = structlog.get_logger("transport.ucx")


async def worker_for(endpoint: LinkOwner) -> UcxWorker:
    """The endpoint's UCX worker, created (and its progress task started) on first use."""
    worker = _workers.get(endpoint)
    if worker is None:
        worker = _workers[endpoint] = UcxWorker(endpoint.name)
        await endpoint.nursery.start(worker.run)
    return worker


def parse_address(address: str) -> bytes:
    """The worker address in `ucx://<hex>` (or the part after `ucx://`); ValueError naming it."""
    text = address.removeprefix("ucx://")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if not raw:
        raise ValueError(f"bad ucx address {address!r}: expected ucx://<hex worker address>")
    return raw


def _link(endpoint: LinkOwner, worker: UcxWorker, role: Role) -> UcxLink:
    return UcxLink(
        worker,
        local=endpoint.name,
        role=role,
        handler=endpoint,
        layout=endpoint.storage.layout,
        config=endpoint.config,
        faults=endpoint.faults,
    )


async def dial(endpoint: LinkOwner, address: str) -> UcxLink:
    """A UCX link from receiving `endpoint` to the listener at `address` (not yet handshaken).
    Raises `ValueError` for a malformed address, `LinkBroken` when nobody accepts within
    `handshake_timeout`."""
    peer = parse_address(address)
    worker = await worker_for(endpoint)
    link = _link(endpoint, worker, "receiver")
    shown = f"{address[:24]}…"
    timeout = endpoint.config.handshake_timeout
    try:
        link.attach(worker.connect(peer), LISTENER)
        await link.post_control(connect_body(link.number, worker.address))
        with trio.move_on_after(timeout) as waiting:
            body = await link.next_body()
        if waiting.cancelled_caught:
            error = LinkBroken(f"no answer from {shown} within {timeout} s")
        elif kind_of(body, (ACCEPT, GOODBYE)) == GOODBYE:  # the listener's endpoint stopped meanwhile
            error = LinkBroken(f"{shown} closed the link as it accepted it: {parse_goodbye(body)}")
        else:
            number, pid, probe, key = parse_accept(body)
            sender = local_pid(pid, key)
            reads = sender is not None and _reads(endpoint, sender, probe)
            link.accepted(number, sender, reads)
            if endpoint.config.admission is not None:
                await admission.admit(link, endpoint.config.admission, shown, timeout)
            if reads:
                await link.post_control(reads_body())
            _log.info("transfer.ucx_linked", link=link.link_id, endpoint=endpoint.name, copies=link.copies)
            return link
    except (UcxFailed, UcxFrameError, trio.EndOfChannel, trio.ClosedResourceError) as exc:
        error = LinkBroken(f"cannot connect to {shown}: {exc}")
    except LinkBroken as exc:  # not admitted
        error = exc
    except BaseException as exc:
        link.close(LinkClosed(f"connecting to {shown} given up: {exc!r}"))
        raise
    link.close(error)
    raise error


def _reads(endpoint: LinkOwner, pid: int, probe: int) -> bool:
    """Whether a link of `endpoint` reads the host pieces of sender process `pid` itself
    (`transport.links.ucx.reads`): `ucx_copies` says so, its pool is in host memory, and the probe at `probe`
    reads back (logged when it does not)."""
    if endpoint.config.ucx_copies != "cma" or endpoint.storage.device.type != "cpu":
        return False
    refused = readable(pid, probe)
    if refused is not None:
        _log.info("transfer.ucx_cma_refused", endpoint=endpoint.name, pid=pid, reason=refused)
    return refused is None


async def listen(endpoint: LinkOwner, on_accept: Callable[[Link], None]) -> str:
    """Accept UCX links to `endpoint`; returns its address `ucx://<hex worker address>`."""
    worker = await worker_for(endpoint)
    inbox_send, inbox = trio.open_memory_channel[Arrival](math.inf)
    worker.register(inbox_send.send_nowait, LISTENER)
    endpoint.nursery.start_soon(_accept_links, endpoint, worker, inbox, on_accept)
    return f"ucx://{worker.address.hex()}"


async def _accept_links(
    endpoint: LinkOwner,
    worker: UcxWorker,
    inbox: trio.MemoryReceiveChannel[Arrival],
    on_accept: Callable[[Link], None],
) -> None:
    async for arrival in inbox:
        link: UcxLink | None = None
        try:
            await worker.wait([arrival.request])
            number, address = parse_number(arrival.body, CONNECT)
            link = _link(endpoint, worker, "sender")
            link.attach(worker.connect(address), number)
            await link.post_control(accept_body(link.number, os.getpid(), PROBE_ADDRESS, host_key()))
        except (UcxFailed, UcxFrameError, LinkError) as exc:
            _log.warning("transfer.ucx_connect_failed", endpoint=endpoint.name, error=str(exc))
            if link is not None:
                link.close(LinkBroken(f"accepting failed: {exc}"))
            continue
        except BaseException as exc:  # cancelled mid-accept: nobody else would ever close this link
            if link is not None:
                link.close(LinkClosed(f"accepting given up: {describe_exit(exc)}"))
            raise
        if endpoint.config.admission is None:
            on_accept(link)
        else:
            endpoint.nursery.start_soon(_admit_then_accept, endpoint, link, on_accept)


async def _admit_then_accept(endpoint: LinkOwner, link: UcxLink, on_accept: Callable[[Link], None]) -> None:
    """Hand `link` to the endpoint once its receiver proved the cluster secret (in a task of its own:
    a receiver that never answers holds no other accept)."""
    assert endpoint.config.admission is not None
    timeout = endpoint.config.handshake_timeout
    if await admission.admitted(link, endpoint.config.admission, endpoint.name, timeout):
        on_accept(link)
