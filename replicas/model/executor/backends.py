"""The executor's paths, one object each: `EagerBackend`, `KernelBackend`, `GraphBackend`.

A backend answers the questions whose answer depends on the path, and nothing else: how a prefill call
attends (`prefill_attend`), how a decode step runs (`decode`), where tokens are sampled (`sample`), and
the layer ops the model runs with (`ops`). The executor validates the inputs, drives the layers and
holds exactly one backend, chosen at construction (`Executor`); capturing the decode graphs turns a
`KernelBackend` into a `GraphBackend` (`KernelBackend.capture`, called by `Executor.prepare` — at the
load or at a role change, never inside a step).

Every path applies a sequence's `token_mask` (structured outputs) to the logits before its token is
chosen, greedy or sampled.

- `eager`: torch's SDPA over the gathered context; sampling on the host. The CPU path.
- `kernels`: the Triton paged-attention kernels read K/V in place through the block tables (one launch
  per layer for a prefill batch, unless it is fresh prompts of one length on a model that need not be
  batch-invariant, where SDPA's causal kernel is fastest); decode steps launched eagerly through
  `KernelDecoder`; sampling on the device.
- `graphs`: the same, with each decode step replayed from the CUDA graph of its batch-size bucket.

Thread safety: as the executor's (one call at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final

import torch

from replicas.model.attention import (
    SequenceSpan,
    decode_attention,
    plan_decode,
    plan_prefill,
    prefill_attention,
)
from replicas.model.executor.batch import DecodeSequence
from replicas.model.gpu.decode import KernelDecoder
from replicas.model.gpu.options import ExecutorPath
from replicas.model.gpu.prefill import kernel_prefill_attention, plan_kernel_prefill
from replicas.model.gpu.sampling import sample_tokens_on_device
from replicas.model.kv_cache import KVCache
from replicas.model.llama import Attend, Model
from replicas.model.ops import LayerOps
from replicas.model.sampling import SamplingParams, TokenHistory, sample_tokens


class Backend(Protocol):
    """One path of the executor (see the module docstring)."""

    @property
    def path(self) -> ExecutorPath: ...

    @property
    def ops(self) -> LayerOps: ...

    @property
    def graph_batches(self) -> list[int]: ...

    def prefill_attend(self, spans: Sequence[SequenceSpan]) -> Attend: ...

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        indices: list[int],
        *,
        histories: list[TokenHistory | None] | None = None,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]: ...

    def decode(self, sequences: Sequence[DecodeSequence]) -> tuple[torch.Tensor, list[int]]: ...

    def release(self) -> None: ...


def _sdpa_attend(cache: KVCache, spans: Sequence[SequenceSpan]) -> Attend:
    plan = plan_prefill(cache, spans)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return prefill_attention(q, k, v, cache, layer, plan)

    return attend


@final
class EagerBackend:
    """torch's path (see the module docstring)."""

    path: ExecutorPath = "eager"

    def __init__(self, model: Model, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.ops = model.ops

    @property
    def graph_batches(self) -> list[int]:
        return []

    def prefill_attend(self, spans: Sequence[SequenceSpan]) -> Attend:
        return _sdpa_attend(self.cache, spans)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        indices: list[int],
        *,
        histories: list[TokenHistory | None] | None = None,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]:
        return sample_tokens(logits, params, indices, histories=histories, masks=masks)

    def decode(self, sequences: Sequence[DecodeSequence]) -> tuple[torch.Tensor, list[int]]:
        model, cache = self.model, self.cache
        ids = torch.tensor([s.token_id for s in sequences], dtype=torch.int64)
        model.check_token_ids(ids, "decode")
        positions = torch.tensor(
            [s.cached_tokens if s.position is None else s.position for s in sequences], dtype=torch.int64
        )
        cos, sin = model.rotary.cos_sin(positions.to(model.device), model.dtype)
        plan = plan_decode(cache, [s.block_table for s in sequences], [s.cached_tokens for s in sequences])

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return decode_attention(q, k, v, cache, layer, plan)

        hidden = model.run_layers(
            model.embed(ids.to(model.device)), range(model.config.num_layers), cos, sin, attend
        )
        logits = model.logits(hidden)
        tokens = sample_tokens(
            logits,
            [s.sampling for s in sequences],
            [s.cached_tokens + 1 for s in sequences],
            histories=[s.history for s in sequences],
            masks=[s.token_mask for s in sequences],
        )
        return logits, tokens

    def release(self) -> None:
        return None


class _Kernels:
    """What the kernel paths share: the paged-attention kernels and sampling on the device."""

    def __init__(self, model: Model, cache: KVCache, decoder: KernelDecoder, ops: LayerOps) -> None:
        self.model, self.cache, self.decoder, self.ops = model, cache, decoder, ops

    def prefill_attend(self, spans: Sequence[SequenceSpan]) -> Attend:
        cache = self.cache
        uniform = all(s.cached_tokens == 0 for s in spans) and len({s.new_tokens for s in spans}) == 1
        if not self.model.batch_invariant and uniform:
            return _sdpa_attend(cache, spans)
        kernel_plan = plan_kernel_prefill(cache, spans)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            return kernel_prefill_attention(q, k, v, cache, layer, kernel_plan)

        return attend

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        indices: list[int],
        *,
        histories: list[TokenHistory | None] | None = None,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> list[int]:
        return sample_tokens_on_device(logits, params, indices, histories=histories, masks=masks)

    def decode(self, sequences: Sequence[DecodeSequence]) -> tuple[torch.Tensor, list[int]]:
        self.model.check_token_ids(torch.tensor([s.token_id for s in sequences]), "decode")
        return self.decoder.step(sequences)

    def release(self) -> None:
        self.decoder.release()


@final
class KernelBackend(_Kernels):
    """The kernels launched eagerly (see the module docstring)."""

    path: ExecutorPath = "kernels"

    @property
    def graph_batches(self) -> list[int]:
        return []

    def capture(self) -> GraphBackend | str:
        """The graphs path, its decode graphs captured and checked; or why not (the kernels then go on
        eagerly). Seconds on a GPU: run it off the event loop."""
        problem = self.decoder.capture()
        if problem is not None:
            return problem
        return GraphBackend(self.model, self.cache, self.decoder, self.ops)


@final
class GraphBackend(_Kernels):
    """The kernels, decode steps replayed from CUDA graphs (see the module docstring)."""

    path: ExecutorPath = "graphs"

    @property
    def graph_batches(self) -> list[int]:
        return self.decoder.graph_batches

    def without_graphs(self) -> KernelBackend:
        """The kernel path this one was captured from (its graphs released)."""
        self.decoder.release()
        return KernelBackend(self.model, self.cache, self.decoder, self.ops)
