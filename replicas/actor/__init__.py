"""The replica actor (architecture §6): `replica` (the task and what others may call: commands,
snapshot), `wiring` (each run's parts), `intake` (its inbox), `dispatch` (one command) with `commands`
(the roles' table of command handlers), `transitions` (its state, locks and last error), `moves` (the
automatic moves, one table), `recovery` (after a failed run), `roles` (what it does in each state),
`pools` (its pools typed by role), `loader` (its weights and executor), `supervisor` (failures
contained)."""

from replicas.actor.replica import Replica

__all__ = ["Replica"]
