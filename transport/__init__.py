"""Block allocator, block pools, transports and the resumable transfer sessions.

Knows nothing of models or replicas: request headers pass through as opaque `msgspec.Raw`.
"""
