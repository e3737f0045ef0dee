"""The prefill role (architecture §6): the work queue and the choice of a batch (`queue`), batching and
running prompts (`work`), the image embeddings a request waits for (`embeddings`), and the migration
queue that moves each prompt's KV to a decode replica (`migration`)."""

from replicas.prefill.work import PrefillWork

__all__ = ["PrefillWork"]
