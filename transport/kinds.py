"""The transports a node can use, whether each is usable here, and the `auto` rule.

| kind | link | bulk bytes |
|---|---|---|
| `inproc` | endpoints of one process | copied pool to pool (device to device on GPUs) |
| `tcp` | sockets (loopback or network) | sub-framed over the socket; GPU pools staged through pinned host memory |
| `ucx` | ucxx tag messages (`transport.links.ucx.link`) | straight between pools over UCX (shared memory, TCP, RDMA…); GPU pools staged unless UCX has CUDA transports |
| `cuda-ipc` | control over TCP, same host | the sender copies into the receiver's GPU pool, mapped by CUDA IPC |

`auto` picks per link, best first: same process → inproc; same host with GPU pools on both sides →
cuda-ipc; ucxx installed → ucx; otherwise tcp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transport.links.ucx.library import INSTALL_HINT, ucx_installed

TransportKind = Literal["inproc", "tcp", "ucx", "cuda-ipc"]
TransportChoice = Literal["inproc", "tcp", "ucx", "cuda-ipc", "auto"]


def unavailable(kind: TransportChoice, *, device: str) -> str | None:
    """Why transport `kind` cannot serve pools on `device` here, as a sentence; None when it can."""
    if kind == "ucx" and not ucx_installed():
        return f"--transport ucx needs ucxx, which is not installed: {INSTALL_HINT}"
    if kind == "cuda-ipc":
        if not device.startswith("cuda"):
            return (
                f"--transport cuda-ipc moves pools on a GPU; the pools are on {device!r} (use --device cuda)"
            )
        import torch  # not at import: the node's config (and `--help`) loads this module

        if not torch.cuda.is_available():
            return "--transport cuda-ipc needs a CUDA device, and torch.cuda.is_available() is false here"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFacts:
    """What `auto` knows about a link's two endpoints."""

    same_process: bool
    same_host: bool
    gpu_pools: bool  # both pools on CUDA devices


def choose(facts: LinkFacts, *, ucx: bool | None = None) -> tuple[TransportKind, str]:
    """The `auto` choice for a link and why (`ucx`: whether ucxx is installed; None asks)."""
    if facts.same_process:
        return "inproc", "both endpoints are in this process"
    if facts.same_host and facts.gpu_pools:
        return "cuda-ipc", "same host, both pools on GPUs"
    if ucx_installed() if ucx is None else ucx:
        return "ucx", "ucxx is installed"
    return "tcp", "ucxx is not installed"
