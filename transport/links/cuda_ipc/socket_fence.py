"""The cuda-ipc write fence for a closed link (architecture §5.7), carried by its control connection.

A cuda-ipc sender writes into the receiver's pool from its own process, on its own stream, queued behind
its model steps; closing the link does not stop a copy already queued. So the receiver must not reuse a
closed link's blocks until the sender says that no copy can land any more, and a closed link has no
messages left to say it with. The TCP connection says it instead:

- each end keeps a second descriptor of the link's socket (`SocketFence`), so the link closing its own
  socket object sends nothing: the connection ends only when both descriptors of an end are closed;
- the sender's link closes its second descriptor once it has closed and its copies are done (`release`):
  no copy is launched on a closed link, so the receiver reading the end of the connection (or a reset)
  is the fence. A sender process that exits ends the connection too, and its copies with it;
- the receiver's link, once closed, stops writing at once (`stop_writing`: the sender reads the end of
  the stream and closes), then waits for the sender's end (`peer_released`), which its `quiesce` awaits.

A sender that stays alive and silent (stopped, hung) never ends the connection: its blocks stay
quarantined, as a UCX sender's that owes a write (`transport.protocol.fences`).
"""

from __future__ import annotations

import socket
from typing import Final, final

import trio

_DISCARD_BYTES: Final = 65536


@final
class SocketFence:
    """A second descriptor of a connected socket; see the module docstring. Not thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock.dup()
        self._sock.setblocking(False)

    def stop_writing(self) -> None:
        """Shut this end's sending side: the peer reads the end of the stream after what was sent."""
        if self._sock.fileno() == -1:
            return
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:  # not connected any more (the peer reset it): it knows, nothing to tell it
            return

    async def peer_released(self) -> None:
        """Return once the peer has closed its end (the end of the stream, or a reset); what still
        arrives meanwhile is discarded. Cancellable."""
        while self._sock.fileno() != -1:
            await trio.lowlevel.wait_readable(self._sock)
            try:
                if not self._sock.recv(_DISCARD_BYTES):
                    return
            except BlockingIOError:
                continue
            except OSError:  # a reset: the peer's socket is gone as surely as by an orderly close
                return

    def release(self) -> None:
        """Close this descriptor; with the link's own socket closed too, the connection ends."""
        if self._sock.fileno() != -1:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
