"""The JSON-lines control server of architecture §7.

Modules: `lines` (line splitting), `parse` (request lines), `outbox` (bounded reply queue,
`ReplySink`), `handler` (the `ControlHandler` seam the node implements), `errors`, `connection` (one
client) and `server` (listeners). The addresses it listens on are configuration values
(`engine.config.address`): the configuration sits below the server and imports nothing of it. Nothing
is imported here.
"""
