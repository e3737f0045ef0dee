"""Where blocks live: the pure-Python block allocator (`blocks`), the preallocated tensor per named
buffer (`storage`) and host memory for CPU pools (`host_memory`).

Knows no transfer, no link and no backend.
"""
