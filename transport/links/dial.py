"""The transports beyond inproc and tcp, reached through `TransferEndpoint.connect` / `listen_on`.

`ucx` (`transport.links.ucx.connect`) needs the optional `ucx` extra (ucxx), and `cuda-ipc`
(`transport.links.cuda_ipc.link`) needs CUDA pools; their modules are imported only here, when a link is made,
so importing zigzag never needs either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from transport.protocol.link import Link, LinkOwner

ListenKind = Literal["ucx", "cuda-ipc"]


async def dial(endpoint: LinkOwner, address: str) -> Link:
    """A new link (not yet handshaken) from receiving `endpoint` to the sender at `address`."""
    scheme, _, rest = address.partition("://")
    if scheme == "ucx":
        from transport.links.ucx import connect as ucx_connect

        return await ucx_connect.dial(endpoint, address)
    if scheme == "cuda-ipc":
        from transport.links.cuda_ipc import link as cuda_ipc

        host, _, port = rest.rpartition(":")
        return await cuda_ipc.dial(endpoint, host, int(port))
    raise ValueError(
        f"unknown transport address {address!r} (expected inproc://name, tcp://host:port, "
        "ucx://<worker address> or cuda-ipc://host:port)"
    )


async def listen(endpoint: LinkOwner, kind: ListenKind, on_accept: Callable[[Link], None], host: str) -> str:
    """Accept links of `kind` to `endpoint`; returns the address peers connect to."""
    if kind == "ucx":
        from transport.links.ucx import connect as ucx_connect

        return await ucx_connect.listen(endpoint, on_accept)
    from transport.links.cuda_ipc import link as cuda_ipc

    return await cuda_ipc.listen(endpoint, on_accept, host)
