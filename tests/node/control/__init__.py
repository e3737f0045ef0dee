"""The controller's ops on a real node: lock, flush, scale and state transitions (architecture §6)."""
