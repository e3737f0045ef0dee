"""The JSON-lines control server of architecture §7.

Modules: `address` (HOST:PORT / unix:PATH), `lines` (line splitting), `parse` (request lines),
`outbox` (bounded reply queue, `ReplySink`), `handler` (the `ControlHandler` seam the node implements),
`errors`, `connection` (one client) and `server` (listeners). Nothing is imported here, so that
`engine.config` can use `engine.control.address` without importing the server.
"""
