"""The planner: scales prefill and decode replicas by the load (docs/planner.md)."""
