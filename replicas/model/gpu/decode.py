"""Decode steps on the paged-attention kernels: launched eagerly, or replayed from CUDA graphs.

`KernelDecoder.step` fills the step's inputs into preallocated device buffers (`DecodeInputs`), runs the
model over them — every layer writes the fed tokens' K/V through `write_kv` and attends through
`paged_decode_attention`, reading the context in place through the block tables — samples on the
device (`sample_on_device`) and reads the sampled tokens once: the only host sync of a step.
Each sequence's `token_mask` is applied to the logits the step or its graph returned: a graph never
samples, so no row escapes its mask.

Graphs (`capture`, on a CUDA device): one per batch-size bucket (`graph_buckets`), captured after the
weights loaded, largest first, sharing one memory pool (one replay at a time, outputs read before the
next). Each capture is checked: on padded inputs one replay must equal the eager step bit for bit; a
mismatch or an error leaves graphs off for this decoder, with the reason returned (the executor logs
it and runs the kernels eagerly). `release` drops the graphs and their memory (weights released).

Thread safety: one step at a time (the executor's contract); `capture` runs before the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, final

import torch

from replicas.model.gpu.inputs import DecodeInputs, DecodeRow
from replicas.model.gpu.options import bucket_for, graph_buckets
from replicas.model.gpu.sampling import SamplingInputs, sample_on_device
from replicas.model.sampling import SamplingParams, TokenHistory

if TYPE_CHECKING:
    from replicas.model.kv_cache import KVCache
    from replicas.model.llama import Model
    from replicas.model.ops import LayerOps


class StepRow(DecodeRow, Protocol):
    """What a decode step reads of a sequence (`replicas.model.executor.batch.DecodeSequence` has it):
    the executor's batch types sit above the GPU paths, which know them only by this protocol."""

    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def token_mask(self) -> torch.Tensor | None: ...
    @property
    def history(self) -> TokenHistory | None: ...


@final
class KernelDecoder:
    """Decode steps of one executor (one model, one KV cache) on the kernels."""

    def __init__(self, model: Model, cache: KVCache, *, max_batch: int, ops: LayerOps) -> None:
        from replicas.model.kernels.paged_attention import paged_decode_attention, write_kv

        self._write_kv = write_kv
        self._attention = paged_decode_attention
        self.model = model
        self.cache = cache
        self.ops = ops
        self.max_batch = max_batch
        max_blocks = min(-(-model.context_length // cache.block_size), cache.num_blocks)
        self.inputs = DecodeInputs(
            max_batch=max_batch, max_blocks=max_blocks, block_size=cache.block_size, device=cache.device
        )
        self.buckets = graph_buckets(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def graphs_on(self) -> bool:
        return bool(self._graphs)

    @property
    def graph_batches(self) -> list[int]:
        """The buckets with a captured graph, ascending."""
        return sorted(self._graphs)

    # ------------------------------------------------------------------ the step
    def forward(self, batch: int) -> torch.Tensor:
        """Logits `[batch, vocab]` float32 of rows `[0, batch)` of the filled inputs (static shapes: what a
        graph captures)."""
        model, cache, inputs = self.model, self.cache, self.inputs
        cos, sin = model.rotary.cos_sin(inputs.positions[:batch], model.dtype)
        slots = inputs.slots[:batch]
        tables = inputs.block_tables[:batch]
        lengths = inputs.context_lens[:batch]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
            keys, values = cache.keys(layer), cache.values(layer)
            self._write_kv(k, v, keys, values, slots)
            return self._attention(q, keys, values, tables, lengths, block_size=cache.block_size)

        layers = range(model.config.num_layers)
        hidden = model.run_layers(model.embed(inputs.token_ids[:batch]), layers, cos, sin, attend, self.ops)
        return model.logits(hidden, self.ops)

    def step(self, sequences: Sequence[StepRow]) -> tuple[torch.Tensor, list[int]]:
        """One decode step (the caller checked the sequences): logits `[n, vocab]` and sampled tokens.
        A batch larger than the buffers runs in chunks of `max_batch` (rows are independent)."""
        if len(sequences) > self.max_batch:
            parts = [
                self.step(sequences[start : start + self.max_batch])
                for start in range(0, len(sequences), self.max_batch)
            ]
            return torch.cat([p[0] for p in parts]), [t for p in parts for t in p[1]]
        n = len(sequences)
        bucket = bucket_for(n, self.buckets) if self._graphs else None
        self.inputs.fill(sequences, bucket or n)
        if bucket is not None:
            graph, output = self._graphs[bucket]
            graph.replay()
            logits = output[:n].clone()
        else:
            logits = self.forward(n)
        sampling = SamplingInputs.build(
            [s.sampling for s in sequences],
            [s.cached_tokens + 1 for s in sequences],
            logits.device,
            histories=[s.history for s in sequences],
        )
        masks = [s.token_mask for s in sequences]
        return logits, sample_on_device(logits, sampling, masks=masks).tolist()

    # ------------------------------------------------------------------ graphs
    def capture(self) -> str | None:
        """Capture one graph per bucket and check each; None when all are in use, else why none is.
        Writes no cache row (padded inputs)."""
        if self.cache.device.type != "cuda":
            return f"CUDA graphs need a CUDA device; the cache is on {self.cache.device}"
        try:
            return self._capture_all()
        except RuntimeError as exc:  # a capture the driver or an op refused: the eager kernels serve
            self.release()
            return f"capturing the decode graphs failed: {exc}"

    def _capture_all(self) -> str | None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for bucket in sorted(self.buckets, reverse=True):
                self.inputs.pad(bucket)
                for _ in range(2):  # compiles the kernels for this shape, sizes cuBLAS workspaces
                    self.forward(bucket)
                eager = self.forward(bucket).clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    output = self.forward(bucket)
                graph.replay()
                side.synchronize()
                if not torch.equal(output, eager):
                    worst = (output - eager).abs().max().item()
                    self.release()
                    return (
                        f"the decode graph for batch {bucket} differs from the eager step "
                        f"(largest logit difference {worst:.3g})"
                    )
                self._graphs[bucket] = (graph, output)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        return None

    def release(self) -> None:
        """Drop the graphs (and, once nothing else holds it, their memory pool)."""
        self._graphs.clear()
