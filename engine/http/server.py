"""Serving the HTTP API (`engine.http.app`) with hypercorn's Trio worker, in the node's nursery.

`serve_http` binds `HOST:PORT` (port 0: a free one), reports the bound URL through `task_status`, and
serves until cancelled (the node cancels it after draining). The socket is bound here, before hypercorn
serves it, so an address that cannot be had — in use, not permitted, a host that does not resolve or is
not this machine's — is one `HttpServerError` naming the address and what to change, which the node
prints as its one line before exiting 2. Hypercorn's error log goes to the stdlib logger
`hypercorn.error`, which the node routes into its event log as diagnostics. Hypercorn's own access log is
off: the access line is ours (`engine.http.access`), an event in the node's log, unless `access` is None
(`--disable-log-requests`).
"""

from __future__ import annotations

import logging
import socket
from functools import partial
from typing import final

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from engine.http.access import AccessLog
from engine.http.app import HttpApi
from replicas.ports import EventSink


@final
class HttpServerError(Exception):
    """The HTTP API cannot listen on its address (the message names it and the reason)."""


def http_bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_sockets(config: Config, host: str, port: int) -> Sockets:
    """Bind and listen on `config.bind`; `HttpServerError` when the address cannot be had."""
    try:
        sockets = config.create_sockets()
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
    except OSError as exc:  # in use, permission denied, no such host (socket.gaierror), not ours
        reason = exc.strerror or str(exc)
        if isinstance(exc, socket.gaierror):
            reason = f"{reason} (the host does not resolve)"
        raise HttpServerError(
            f"the HTTP API cannot listen on {http_bind(host, port)}: {reason}; choose another address with "
            "--host and --port (or --http HOST:PORT), or turn the API off with --http off"
        ) from None
    return sockets


async def serve_http(
    api: HttpApi,
    host: str,
    port: int,
    *,
    access: EventSink | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `api` on `host:port`, one access line per request to `access` (None: none); `task_status`
    gets the URL (`http://127.0.0.1:8000`). Raises `HttpServerError` before starting when the address
    cannot be bound."""
    config = Config()
    config.bind = [http_bind(host, port)]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0
    sockets = open_sockets(config, host, port)
    asgi = api.app if access is None else AccessLog(api.app, access)
    app = wrap_app(asgi, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(partial(worker_serve, app, config, sockets=sockets))
        task_status.started(urls[0])
