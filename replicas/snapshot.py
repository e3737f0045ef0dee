"""What others may read of a replica: one frozen snapshot of its state and load (architecture §6).

A replica is closed: the router, the controller, the planner, `status`, the cluster's reports and the
other replicas read its `ReplicaSnapshot` and send it commands; none of them touches its queues, pools
or role objects. A snapshot is taken on demand (`Replica.snapshot()`), so it is as fresh as the moment it
was asked for; the queue's prompt tokens are summed in one place, the replica's. A replica of another
node has one too, built from its node's last report (`engine.cluster`).

What it accepts: `takes_prefill` — its state takes new prefill work (Prefill; OldPrefill while its
episode lets it; NewPrefill while it has room for another batch), with `prefill_limit` the longest
prompt it takes now (None: any); `embedding_pool` — it can receive image embeddings; an encode replica
takes images in `Encode`. `has_room` is the router's rule on top: a replica's queue holds at most its
next batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from messages.control import LockReason, WeightsSource
from messages.log.events import ReplicaBlocks
from replicas.model.gpu.options import ExecutorPath
from replicas.states import ReplicaState, Role


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSnapshot:
    """One replica at one moment (see the module docstring). Block counts come from the allocators."""

    name: str
    role: Role  # the role it was configured for (its pools)
    state: ReplicaState
    serving_role: Role  # the role `status` shows: the one its state serves, else `role`
    locked: bool
    lock_reasons: tuple[LockReason, ...]
    last_error: str | None
    running: bool  # its task runs (between a failure and its restart it does not)
    work_queue: int
    migration_queue: int
    queued_prompts: int
    queued_prompt_tokens: int
    running_prompt_tokens: int = 0  # the prompt tokens of the batch it computes now
    decoding: int  # requests in its decode batch
    encode_load: int  # pixels of the images queued or in flight (an encode replica)
    embedding_pool: bool
    takes_prefill: bool
    prefill_limit: int | None
    used_blocks: int
    cached_blocks: int  # KV blocks in use (for requests; the prefix cache's unreferenced ones not)
    kv_blocks: int  # KV blocks in all
    total_blocks: int
    loaded_layers: int = 0
    total_layers: int = 0
    weights_source: WeightsSource | None = None
    weights_bytes_loaded: int = 0
    serves_weights: bool = False  # holds fully loaded weights a peer copy may read (`replicas.loading`)
    paired_with: tuple[str, ...] = ()
    executor: ExecutorPath | None = None
    executor_fallbacks: tuple[str, ...] = ()
    prefix_blocks: int = 0  # KV blocks its prefix cache holds (docs/prefix-cache.md)
    prefix_evicted: int = 0  # KV blocks its prefix cache evicted since it started

    def takes(self, prompt_tokens: int, *, images: bool) -> bool:
        """Whether its state takes a new request of `prompt_tokens` tokens (`images`: with images)."""
        return (
            self.takes_prefill
            and (self.prefill_limit is None or prompt_tokens <= self.prefill_limit)
            and (not images or self.embedding_pool)
        )

    def spare_compute(self, *, images: bool) -> bool:
        """A NewPrefill with spare compute for a prompt (`images`: with images) — taking prompts, its
        room not spent (`replicas.zigzag.limits`): its OldPrefill partner then takes none of the prompts
        of at most a batch (docs/zigzag.md), which wait for this one's room."""
        return (
            self.state is ReplicaState.NEW_PREFILL
            and self.takes_prefill
            and self.prefill_limit is not None
            and self.prefill_limit >= 0
            and (not images or self.embedding_pool)
        )

    def has_room(self, prompt_tokens: int, budget: int) -> bool:
        """Its queue holds at most its next batch (`budget` prompt tokens, or one longer prompt): the
        rest waits at the router, so a replica that starts serving later (a scale-up) takes its share
        of a backlog instead of finding it committed to the replicas that were there first."""
        return not self.queued_prompts or self.queued_prompt_tokens + prompt_tokens <= budget

    @property
    def prompt_tokens_ahead(self) -> int:
        """The prompt tokens a new prompt would wait behind here: those queued and those computing now.
        An idle replica has none, so a router choosing by it never leaves one idle for a busy one."""
        return self.queued_prompt_tokens + self.running_prompt_tokens

    @property
    def load(self) -> int:
        """How busy it is, for choosing among replicas of a role: blocks held plus queued work."""
        return self.used_blocks + self.work_queue + self.migration_queue

    def blocks(self) -> ReplicaBlocks:
        """Its blocks as the controller's block report logs them."""
        return ReplicaBlocks(
            replica=self.name,
            state=self.state.value,
            used_blocks=self.used_blocks,
            cached_blocks=self.cached_blocks,
            total_blocks=self.total_blocks,
            locked=self.locked,
            prefix_blocks=self.prefix_blocks,
            prefix_evicted=self.prefix_evicted,
        )
