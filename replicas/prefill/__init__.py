"""The prefill role (architecture §6): batching the work queue and running prompts (`work`), and the migration
queue that moves each prompt's KV to a decode replica (`migration`)."""

from replicas.prefill.work import Prefilled, PrefillWork

__all__ = ["PrefillWork", "Prefilled"]
