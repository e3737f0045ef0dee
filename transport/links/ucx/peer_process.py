"""Which process is at the far end of a UCX link, when it runs on this host.

A scattered receive (`transport.links.ucx.scatter`) is written by the sender process itself. Once UCX has
matched it, only that process can complete it, so a link that closes with such a receive pending can
call its memory safe only when the write has landed or the writer no longer exists (`process_gone`). The
sender tells its pid in the UCX accept body, with this host's key; a pid means something only when the
key is ours — same boot, same pid namespace — so `local_pid` returns None for a peer on another host or
in another container, and such peers get contiguous receives instead (which the receiver itself copies).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def host_key() -> bytes:
    """This host's boot id and this process's pid namespace; empty where Linux's /proc lacks them (no
    scattered receives there)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return b""
    return f"{boot}/{namespace}".encode()


def local_pid(pid: int, key: bytes) -> int | None:
    """`pid` when a peer with host key `key` runs on this host in this pid namespace, else None."""
    return pid if key and key == host_key() else None


def process_gone(pid: int) -> bool:
    """Whether process `pid` (of this host and namespace) has exited: no such process, or a zombie,
    whose memory — and so any write it could still make — is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # it exists, and /proc will not say more: assume it lives
    state = stat.rpartition(")")[2].split()[:1]  # the command name, in parentheses, may hold spaces
    return state in (["Z"], ["X"])
