"""The control server: JSON lines over TCP or a unix socket (architecture §7), one `ControlConnection` per client.

Usage (the node)::

    server = ControlServer(handler, config.control, log)
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve, config.listen_address)
        ...
        server.stop_accepting()   # shutdown: no new clients; open connections keep working
        ...                       # drain in-flight requests
        server.close()            # end every connection's requests, send what is queued; `serve` returns
        await server.wait_closed()

`serve` owns the listeners and a nursery holding every connection, so cancelling it cancels every request
task of every client (the node's handler frees their blocks in shielded cleanup) and drops what is
queued; `close` does the same in order: each request ends with its final reply, which is sent.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
from typing import Final, final

import trio

from engine.config import ControlConfig
from engine.config.address import Address, TcpAddress, UnixAddress
from engine.control.connection import ControlConnection
from engine.control.handler import ControlHandler
from engine.control.outbox import ConnectionInfo
from engine.logging import EventLog
from messages.log.events import ClientConnected

# Accept errors that mean "too many open files for now": wait a little instead of failing the server.
_CAPACITY_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_CAPACITY_BACKOFF_S: Final = 0.1
_UNIX_BACKLOG: Final = 128


@final
class ControlServerError(Exception):
    """The server cannot listen on its address (in use, not permitted, a non-socket file in the way)."""


@final
class ControlServer:
    def __init__(
        self, handler: ControlHandler, limits: ControlConfig, log: EventLog, token: bytes | None = None
    ) -> None:
        """`token`: each connection's first line must carry it (`engine.control.connection`)."""
        self._handler = handler
        self._token = token
        self._limits = limits
        self._log = log
        self._connections: set[ControlConnection] = set()
        self._ids = itertools.count(1)
        self._accept_scope = trio.CancelScope()
        self._serve_scope = trio.CancelScope()
        self._closing = False
        self._served = trio.Event()
        self._address: Address | None = None
        self._request_ended = trio.Event()

    @property
    def address(self) -> Address:
        """The bound address (a TCP port 0 resolved), once `serve` has started."""
        if self._address is None:
            raise RuntimeError("the control server has not started")
        return self._address

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def in_flight(self) -> int:
        """Requests in flight over every connection."""
        return sum(connection.in_flight for connection in self._connections)

    async def wait_requests_done(self) -> None:
        """Until no request is in flight on any connection: each has queued its final reply, which a
        closing connection still sends. Cancellation: just stops waiting."""
        while True:
            ended = self._request_ended = trio.Event()
            if not self.in_flight:
                return
            await ended.wait()

    def _note_request_end(self) -> None:
        self._request_ended.set()

    def stop_accepting(self) -> None:
        """Close the listeners (a unix socket file is removed); open connections keep being served."""
        self._accept_scope.cancel()

    async def wait_closed(self) -> None:
        """Until `serve` has returned (after `close`: every connection sent its last replies and closed)."""
        await self._served.wait()

    def close(self) -> None:
        """Stop accepting and close every connection (`ControlConnection.close`: its requests end with a
        `cancelled` error, what is queued is sent); `serve` returns once they have closed, or after the
        write timeout, when what is left is cancelled."""
        self._closing = True
        self._accept_scope.cancel()
        for connection in list(self._connections):
            connection.close()
        self._serve_scope.deadline = min(
            self._serve_scope.deadline, trio.current_time() + self._limits.client_write_timeout
        )

    async def serve(
        self, address: Address, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on `address` and serve clients until `close` or cancellation.

        Reports the bound address through `task_status` (use ``nursery.start``). Raises
        `ControlServerError` before starting when the address cannot be bound (the call may then be
        retried); a server that has started cannot serve again.
        """
        if self._address is not None:
            raise RuntimeError(f"this ControlServer already served {self._address}; create one per address")
        listeners = await _open_listeners(address)
        self._address = _bound_address(address, listeners[0])
        try:
            with self._serve_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._accept_all, listeners, address, nursery)
                    task_status.started(self._address)
        finally:
            self._served.set()

    async def _accept_all(
        self, listeners: list[trio.SocketListener], address: Address, nursery: trio.Nursery
    ) -> None:
        try:
            with self._accept_scope:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept, listener, nursery)
        finally:
            with trio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()
                if isinstance(address, UnixAddress):
                    _remove_socket_file(address.path)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                await trio.sleep(_CAPACITY_BACKOFF_S)
                continue
            nursery.start_soon(self._run_connection, stream)

    async def _run_connection(self, stream: trio.SocketStream) -> None:
        info = ConnectionInfo(connection=f"c{next(self._ids)}", peer=_peer(stream))
        connection = ControlConnection(
            stream,
            self._handler,
            self._limits,
            self._log,
            info,
            on_request_end=self._note_request_end,
            token=self._token,
        )
        self._connections.add(connection)
        self._log.emit(ClientConnected(connection=info.connection, peer=info.peer))
        if self._closing:  # accepted just before `close`
            connection.close()
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)


async def _open_listeners(address: Address) -> list[trio.SocketListener]:
    if isinstance(address, TcpAddress):
        try:
            return await trio.open_tcp_listeners(address.port, host=address.host)
        except OSError as exc:
            raise ControlServerError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    await _clear_stale_socket(address.path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(address.path)
        sock.listen(_UNIX_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ControlServerError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    return [trio.SocketListener(sock)]


async def _clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead server; refuse a live one or a file that is not a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlServerError(f"cannot listen on unix:{path}: the path exists and is not a socket")
    try:
        probe = await trio.open_unix_socket(path)
    except ConnectionRefusedError:
        os.unlink(path)
        return
    await probe.aclose()
    raise ControlServerError(f"cannot listen on unix:{path}: another server is listening there")


def _remove_socket_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return


def _bound_address(address: Address, listener: trio.SocketListener) -> Address:
    if isinstance(address, UnixAddress):
        return address
    host, port = listener.socket.getsockname()[:2]
    return TcpAddress(host=host, port=port)


def _peer(stream: trio.SocketStream) -> str:
    try:
        name = stream.socket.getpeername()
    except OSError:  # the client already reset the connection; its reader will see that
        return "gone"
    if isinstance(name, tuple):
        host = f"[{name[0]}]" if ":" in name[0] else name[0]
        return f"{host}:{name[1]}"
    return f"unix:{name}" if name else "unix"
