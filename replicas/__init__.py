"""Replica actors, their state machine and role loops, and the model executor (the only torch compute)."""
