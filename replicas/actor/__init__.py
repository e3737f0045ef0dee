"""The replica actor (architecture §6): `replica` (the task, its inbox, its commands and snapshot),
`roles` (what it does in each state), `pools` (its pools typed by role), `loader` (its weights and
executor), `supervisor` (failures contained)."""

from replicas.actor.replica import Replica

__all__ = ["Replica"]
