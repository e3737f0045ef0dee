"""The incarnation this node knows each other node as: the lease of its etcd record (docs/cluster.md,
"Failures").

A node that restarts, or is cut off long enough to lose its lease, comes back under a new lease: a new
incarnation, which shares nothing with the old one. The member's membership watch is the one writer
(`know`, `forget`); frames count only under the sender's known lease (`counts`), and peer links dial a
node under it (`lease_of`).
"""

from __future__ import annotations

from typing import final


@final
class Incarnations:
    """Node id → the lease this node knows it under. A node absent here is not known (never seen in
    etcd, or gone): nothing it sends counts until its record arrives."""

    def __init__(self) -> None:
        self._leases: dict[str, int] = {}

    def __contains__(self, node: object) -> bool:
        return node in self._leases

    def nodes(self) -> list[str]:
        """The nodes known now."""
        return list(self._leases)

    def lease_of(self, node: str) -> int | None:
        """The lease `node` is known under; None: not known."""
        return self._leases.get(node)

    def counts(self, node: str, lease: int) -> bool:
        """A frame `node` sent under `lease` is its known incarnation's."""
        return self._leases.get(node) == lease

    def know(self, node: str, lease: int) -> bool:
        """`node` is known under `lease` from now on; True when that is news (first seen, or a new lease
        — the caller ended what it shared with the old one first, `forget`)."""
        new = self._leases.get(node) != lease
        self._leases[node] = lease
        return new

    def forget(self, node: str) -> int:
        """`node` left (or its incarnation ended): not known any more. Returns the lease it was known
        under (0: none)."""
        return self._leases.pop(node, 0)
