"""The batch-level API a replica calls: prefill (any layer range) and decode on one KV cache.

An `Executor` pairs the shared, read-only `Model` with one replica's `KVCache`. Calls are synchronous and
meant to run off the event loop (`trio.to_thread.run_sync`); torch releases the GIL inside its kernels.
Different executors (different caches) may run concurrently on the same model; one executor must not be
called from two threads at once. A call that raises has validated its inputs first: nothing is written
to the cache when a `ModelInputError` is raised. Block allocation is the caller's job: before each call,
every sequence's block table must hold `cached_tokens + new tokens` tokens (`KVCache.blocks_for`).

Paths (`path`, shown by `status`), one backend object each (`replicas.model.executor.backends`):
`graphs` — the Triton kernels read K/V in place through the block tables, decode steps replay CUDA
graphs captured per batch-size bucket (`prepare`); `kernels` — the same kernels launched eagerly; `eager`
— torch's SDPA over the gathered context (the CPU path). The choice is made at construction from the
device and the options; a path that fails its check falls back with the reason in `fallbacks` (and a log
line), never to wrong tokens. Graphs are captured by `prepare` alone — when a decode replica loads, or
when a replica becomes one — never inside a step: a decode step before `prepare` runs the kernels
eagerly. See replicas/model/gpu/.

Cancellation: a call cannot be interrupted. Run it with `trio.to_thread.run_sync` without abandoning
it on cancel, so a cancelled replica waits for the call to return before it frees the request's blocks —
the executor never writes into a block after the allocator gave it to someone else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import final

import structlog
import torch

from replicas.model.attention import SequenceSpan, avoid_cudnn_attention
from replicas.model.errors import ContextLengthError, InvalidBatchError, KernelsUnavailableError
from replicas.model.executor.backends import Backend, EagerBackend, GraphBackend, KernelBackend
from replicas.model.executor.batch import DecodeResult, DecodeSequence, PrefillResult, PrefillSequence
from replicas.model.executor.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs, score
from replicas.model.gpu.check import kernels_problem
from replicas.model.gpu.decode import KernelDecoder
from replicas.model.gpu.options import AttentionChoice, ExecutorPath, GraphsChoice
from replicas.model.kv_cache import KVCache
from replicas.model.llama import Model
from replicas.model.ops import LayerOps, kernel_ops

_log = structlog.get_logger("replicas.model.executor")


@final
class Executor:
    """Runs a model against one KV cache.

    `attention` and `cuda_graphs`: see `replicas.model.gpu.options`. A batch-invariant model
    (`Model.batch_invariant`) runs the kernels whatever `attention` says. `max_batch`: the decode batch
    the step buffers (and the largest graph) are sized for; larger batches run in chunks.
    """

    def __init__(
        self,
        model: Model,
        cache: KVCache,
        *,
        attention: AttentionChoice = "auto",
        cuda_graphs: GraphsChoice = "off",
        max_batch: int = 64,
    ) -> None:
        if cache.config != model.config:
            raise InvalidBatchError(f"KV cache was built for another model config than {model.name!r}")
        if cache.device != model.device:
            raise InvalidBatchError(f"KV cache is on {cache.device}, model {model.name!r} on {model.device}")
        self.model = model
        self.cache = cache
        self.fallbacks: list[str] = []
        self._want_graphs = cuda_graphs == "auto" and cache.device.type == "cuda"
        self.backend: Backend = EagerBackend(model, cache)
        avoid_cudnn_attention(model.device)
        wanted = (
            model.batch_invariant
            or attention == "kernels"
            or (attention == "auto" and cache.device.type == "cuda")
        )
        if wanted:
            config = model.config
            with self._on_device():
                problem = kernels_problem(
                    cache.device,
                    model.dtype,
                    config.num_heads,
                    config.num_kv_heads,
                    config.head_dim,
                    invariant=model.batch_invariant,
                )
            if problem is None:
                ops = model.ops if model.batch_invariant else kernel_ops()
                decoder = KernelDecoder(model, cache, max_batch=max_batch, ops=ops)
                self.backend = KernelBackend(model, cache, decoder, ops)
            elif model.batch_invariant:
                raise KernelsUnavailableError(f"{model.name!r} is batch-invariant, but {problem}")
            else:
                self._fall_back(problem, "eager")

    @property
    def path(self) -> ExecutorPath:
        return self.backend.path

    @property
    def ops(self) -> LayerOps:
        """The layer ops the model runs with on this path."""
        return self.backend.ops

    @property
    def graph_batches(self) -> list[int]:
        """The batch sizes decode graphs are captured for (empty off the `graphs` path)."""
        return self.backend.graph_batches

    @property
    def needs_prepare(self) -> bool:
        """Whether `prepare` has graphs to capture (call it in a worker thread before decoding)."""
        return self._want_graphs and isinstance(self.backend, KernelBackend)

    def prepare(self) -> ExecutorPath:
        """Capture the decode graphs when they are wanted (seconds on a GPU: off the event loop): the
        kernel path becomes the graphs path; on a failed capture or check the kernels run eagerly and
        the reason is in `fallbacks`. Idempotent. Needs the whole model loaded. Returns the path."""
        backend = self.backend
        if self._want_graphs and isinstance(backend, KernelBackend):
            self.model.check_layer_range(range(self.model.config.num_layers))
            with self._on_device():
                captured = backend.capture()
            if isinstance(captured, GraphBackend):
                self.backend = captured
            else:
                self._want_graphs = False
                self._fall_back(captured, "kernels")
        return self.path

    def release(self) -> None:
        """Drop the graphs (the weights are being released): the graphs path is the kernel path again;
        the executor must not be used after."""
        backend = self.backend
        self.backend = backend.without_graphs() if isinstance(backend, GraphBackend) else backend
        self.backend.release()
        self._want_graphs = False

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        """The cache's CUDA device made current (Triton launches on the current device; a worker thread
        starts on device 0)."""
        if self.cache.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.cache.device)

    def _fall_back(self, reason: str, to: ExecutorPath) -> None:
        self.fallbacks.append(reason)
        _log.warning("executor.fallback", model=self.model.name, to=to, reason=reason)

    def prefill(
        self,
        sequences: Sequence[PrefillSequence],
        *,
        layers: range | None = None,
        hidden: torch.Tensor | None = None,
        head: bool = True,
    ) -> PrefillResult:
        """Run `layers` (default all) over a batch; KV is written only for those layers.

        `hidden` is the packed `[sum T, hidden]` output of the range before: required when
        `layers.start > 0`; at layer 0 it may replace the input embeddings (images merged). An empty
        range is allowed at the two ends: `range(0, 0)` returns the input embeddings, `range(L, L)` runs
        only the final norm and head on `hidden` (ZigZag hands a batch over at any layer boundary).
        Returns hidden states, or — when `layers` ends the model and `head` is true — logits and
        sampled first tokens.
        """
        model = self.model
        num_layers = model.config.num_layers
        layer_range = range(num_layers) if layers is None else layers
        empty = len(layer_range) == 0 and layer_range.step == 1 and layer_range.start in (0, num_layers)
        if empty:
            if layer_range.start == num_layers and head:
                model.check_layer_range(range(num_layers - 1, num_layers))
        else:
            model.check_layer_range(layer_range, head=head)
        self._check_prefill(sequences, layer_range, hidden)
        with torch.inference_mode(), self._on_device():
            if layer_range.start == 0 and hidden is None:
                hidden = self._input_embeddings(sequences)
            else:
                assert hidden is not None
                hidden = hidden.to(device=model.device, dtype=model.dtype, copy=True)
            if empty:
                out = hidden
            else:
                cos, sin = model.rotary.cos_sin(self._prefill_positions(sequences), model.dtype)
                spans = [SequenceSpan(s.block_table, s.cached_tokens, s.num_tokens) for s in sequences]
                out = model.run_layers(
                    hidden, layer_range, cos, sin, self.backend.prefill_attend(spans), self.ops
                )
            if layer_range.stop < num_layers or not head:
                return PrefillResult(hidden=out, logits=None, tokens=None)
            last = torch.tensor([s.num_tokens for s in sequences], dtype=torch.int64).cumsum(0) - 1
            logits = model.logits(out.index_select(0, last.to(out.device)), self.ops)
            params = [s.sampling for s in sequences]
            indices = [s.cached_tokens + s.num_tokens for s in sequences]
            tokens = self.backend.sample(
                logits,
                params,
                indices,
                histories=[s.history for s in sequences],
                masks=[s.token_mask for s in sequences],
            )
            logprobs = _scored(logits, tokens, [s.logprobs for s in sequences])
            prompt_logprobs = None
            if any(s.prompt_logprobs is not None for s in sequences):
                prompt_logprobs = self._prompt_logprobs(sequences, out, last.tolist())
            return PrefillResult(
                hidden=None, logits=logits, tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )

    def decode(self, sequences: Sequence[DecodeSequence]) -> DecodeResult:
        """One step for every sequence: writes each fed token's KV, returns logits and sampled tokens."""
        model = self.model
        model.check_layer_range(range(model.config.num_layers))
        if not sequences:
            raise InvalidBatchError("decode: empty batch")
        for index, seq in enumerate(sequences):
            self._check_length(seq.cached_tokens, 1, f"decode sequence {index}")
            self.cache.check_block_table(seq.block_table, seq.cached_tokens + 1, f"decode sequence {index}")
        with torch.inference_mode(), self._on_device():
            logits, tokens = self.backend.decode(sequences)
            logprobs = _scored(logits, tokens, [s.logprobs for s in sequences])
        return DecodeResult(logits=logits, tokens=tokens, logprobs=logprobs)

    # ------------------------------------------------------------------ helpers
    def _prompt_logprobs(
        self, sequences: Sequence[PrefillSequence], out: torch.Tensor, last: list[int]
    ) -> list[list[TokenLogprobs] | None]:
        """Each asking sequence's prompt tokens scored from the rows before them (`PrefillSequence`)."""
        scored: list[list[TokenLogprobs] | None] = []
        for seq, end in zip(sequences, last, strict=True):
            if seq.prompt_logprobs is None:
                scored.append(None)
                continue
            ids = torch.as_tensor(seq.token_ids, dtype=torch.int64).reshape(-1).tolist()
            targets = ids[1:] + ([] if seq.next_token is None else [seq.next_token])
            if not targets:
                scored.append([])
                continue
            start = end - seq.num_tokens + 1
            rows = out[start : start + len(targets)]
            pieces: list[TokenLogprobs] = []
            for at in range(0, len(targets), 256):  # [rows, vocab] float32 logits, a piece at a time
                logits = self.model.logits(rows[at : at + 256], self.ops)
                pieces += score(logits, targets[at : at + 256], seq.prompt_logprobs)
            scored.append(pieces)
        return scored

    def _check_length(self, cached: int, new: int, what: str) -> None:
        if cached < 0:
            raise InvalidBatchError(f"{what}: cached_tokens must be >= 0, got {cached}")
        if cached + new > self.model.context_length:
            raise ContextLengthError(
                f"{what}: {cached + new} tokens exceed the context of {self.model.context_length} tokens "
                f"of {self.model.name!r}"
            )

    def _check_prefill(
        self, sequences: Sequence[PrefillSequence], layers: range, hidden: torch.Tensor | None
    ) -> None:
        if not sequences:
            raise InvalidBatchError("prefill: empty batch")
        config = self.model.config
        total = 0
        for index, seq in enumerate(sequences):
            what = f"prefill sequence {index}"
            if seq.num_tokens < 1:
                raise InvalidBatchError(f"{what}: no tokens")
            for name, top in (("logprobs", seq.logprobs), ("prompt_logprobs", seq.prompt_logprobs)):
                if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                    raise InvalidBatchError(f"{what}: {name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
            self._check_length(seq.cached_tokens, seq.num_tokens, what)
            self.cache.check_block_table(seq.block_table, seq.cached_tokens + seq.num_tokens, what)
            total += seq.num_tokens
            if seq.positions is not None:
                shape = list(seq.positions.shape)
                allowed = [[seq.num_tokens]] + ([[seq.num_tokens, 3]] if config.position_axes == 3 else [])
                if shape not in allowed:
                    raise InvalidBatchError(
                        f"{what}: positions have shape {shape}, expected one of {allowed}"
                    )
            if (seq.embeds is None) != (seq.embed_indices is None):
                raise InvalidBatchError(f"{what}: embeds and embed_indices go together")
            if seq.embeds is not None and seq.embed_indices is not None:
                rows = len(seq.embed_indices)
                if list(seq.embeds.shape) != [rows, config.hidden_size]:
                    raise InvalidBatchError(
                        f"{what}: embeds have shape {list(seq.embeds.shape)}, expected [{rows}, {config.hidden_size}]"
                    )
                indices = torch.as_tensor(seq.embed_indices, dtype=torch.int64)
                if rows and (int(indices.min()) < 0 or int(indices.max()) >= seq.num_tokens):
                    raise InvalidBatchError(f"{what}: embed_indices outside [0, {seq.num_tokens})")
        if layers.start == 0 and hidden is None:
            return
        expected = [total, config.hidden_size]
        if hidden is None or list(hidden.shape) != expected:
            got = None if hidden is None else list(hidden.shape)
            raise InvalidBatchError(
                f"prefill from layer {layers.start}: hidden states {got}, expected {expected}"
            )

    def _input_embeddings(self, sequences: Sequence[PrefillSequence]) -> torch.Tensor:
        model = self.model
        ids = torch.cat([torch.as_tensor(s.token_ids, dtype=torch.int64).reshape(-1) for s in sequences])
        for index, seq in enumerate(sequences):
            model.check_token_ids(
                torch.as_tensor(seq.token_ids, dtype=torch.int64), f"prefill sequence {index}"
            )
        hidden = model.embed(ids.to(model.device))
        offset = 0
        for seq in sequences:
            if seq.embeds is not None and seq.embed_indices is not None:
                rows = torch.as_tensor(seq.embed_indices, dtype=torch.int64, device=model.device) + offset
                hidden.index_copy_(0, rows, seq.embeds.to(device=model.device, dtype=model.dtype))
            offset += seq.num_tokens
        return hidden

    def _prefill_positions(self, sequences: Sequence[PrefillSequence]) -> torch.Tensor:
        pieces = []
        three_d = any(s.positions is not None and s.positions.dim() == 2 for s in sequences)
        for seq in sequences:
            if seq.positions is None:
                piece = torch.arange(seq.cached_tokens, seq.cached_tokens + seq.num_tokens, dtype=torch.int64)
            else:
                piece = seq.positions.to(torch.int64).cpu()
            if three_d and piece.dim() == 1:
                piece = piece[:, None].expand(-1, 3)
            pieces.append(piece)
        return torch.cat(pieces).to(self.model.device)


def _scored(
    logits: torch.Tensor, tokens: list[int], wanted: list[int | None]
) -> list[TokenLogprobs | None] | None:
    """The sampled tokens' log-probabilities for the rows that asked; None when none did."""
    rows = [row for row, top in enumerate(wanted) if top is not None]
    if not rows:
        return None
    top = max(wanted[row] or 0 for row in rows)
    picked = logits.index_select(0, torch.tensor(rows, device=logits.device))
    scored = score(picked, [tokens[row] for row in rows], top)
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    for row, entry in zip(rows, scored, strict=True):
        k = wanted[row] or 0
        out[row] = TokenLogprobs(entry.token_id, entry.logprob, entry.top[:k])
    return out
