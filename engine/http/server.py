"""Serving the HTTP API (`engine.http.app`) with hypercorn's Trio worker, in the node's nursery.

`serve_http` binds `HOST:PORT` (port 0: a free one), reports the bound URL through `task_status`, and
serves until cancelled (the node cancels it after draining). Hypercorn's error log goes to the stdlib
logger `hypercorn.error`, which the node routes into its event log as diagnostics; there is no access log
(every request is an event already).
"""

from __future__ import annotations

import logging
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from engine.http.app import HttpApi


async def serve_http(api: HttpApi, host: str, port: int, *, task_status: trio.TaskStatus[str]) -> None:
    """Serve `api` on `host:port`; `task_status` gets the URL (`http://127.0.0.1:8000`)."""
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0

    async with trio.open_nursery() as nursery:
        urls: list[str] = await nursery.start(partial(serve, api.app, config))  # type: ignore[arg-type]
        task_status.started(urls[0])
