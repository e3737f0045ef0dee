"""The Llama-architecture decoder (Llama, Qwen2, the built-in tiny model) with layer-range execution.

A `Model` is the read-only weights plus the pieces that are fixed per model (rotary tables, tokenizer,
vision encoder). One `Model` is shared by every replica of the model in the process; each replica has
its own `KVCache` and `Executor`. Layers may be filled in one by one while the model is loading
(`set_layer`); `loaded_layers` says how many leading layers are ready.

Invariants: weights never change after `set_layer`; no method mutates shared state except the vision
encoder's invocation counter (which has its own lock).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, final

import torch
import torch.nn.functional as F

from replicas.model.config import ModelConfig
from replicas.model.errors import InvalidBatchError, TokenIdError
from replicas.model.kv_cache import DEFAULT_KV_BLOCK_SIZE, kv_layout
from replicas.model.layers import LayerWeights
from replicas.model.linear import Kernels, Linear
from replicas.model.ops import TORCH_OPS, LayerOps, invariant_ops
from replicas.model.rope import Rotary
from transport.memory.storage import torch_dtype

if TYPE_CHECKING:
    from messages.layout import PoolLayout
    from replicas.model.text.tokenizer import Tokenizer
    from replicas.model.vision import VisionEncoder

# (q [N, heads, d], k [N, kv_heads, d], v [N, kv_heads, d], layer) -> [N, heads * d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@final
class Model:
    """Weights of a decoder-only model in `config.dtype` on `device`."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: str | torch.device = "cpu",
        embed_tokens: torch.Tensor,
        tokenizer: Tokenizer | None = None,
        vision: VisionEncoder | None = None,
        eos_token_ids: Collection[int] = (),
        name: str = "model",
        kernels: Kernels = "auto",
        batch_invariant: bool = False,
        pack_tied_head: bool = True,
    ) -> None:
        """`batch_invariant`: run the batch-invariant Triton kernels (`replicas.model.ops`); the weights
        must then be plain (`kernels="plain"`), which the loaders do when asked for it. `pack_tied_head`:
        whether a tied output head may multiply with a packed copy of the embedding table (`set_head`)."""
        self.config = config
        self.name = name
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        self.embed_tokens = embed_tokens
        self.kernels = "plain" if batch_invariant else kernels
        self.batch_invariant = batch_invariant
        self.pack_tied_head = pack_tied_head
        self.ops: LayerOps = invariant_ops() if batch_invariant else TORCH_OPS
        self.final_norm: torch.Tensor | None = None
        self.lm_head: Linear | None = None
        self.layers: list[LayerWeights | None] = [None] * config.num_layers
        self.rotary = Rotary(config.rope, config.head_dim, self.device)
        self.tokenizer = tokenizer
        self.vision = vision
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(config.eos_token_ids)
        self.context_length = config.max_position_embeddings

    # ------------------------------------------------------------------ loading
    def set_layer(self, index: int, weights: LayerWeights) -> None:
        self.layers[index] = weights

    def set_head(self, final_norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Install the final norm and the output projection (`lm_head` may be `embed_tokens`: tied).

        The lookups need the embedding table plain, so a tied head packed (`replicas.model.linear`)
        multiplies with a packed copy of it: the model's largest matrix held twice, for a product two to
        four times faster at decode batch sizes. With `pack_tied_head` False a tied head multiplies with
        the table itself (`F.linear`), holding it once. The packed copy's values are the table's."""
        self.final_norm = final_norm
        tied = lm_head.data_ptr() == self.embed_tokens.data_ptr()
        kernels = "plain" if tied and not self.pack_tied_head else self.kernels
        self.lm_head = Linear(lm_head, None, kernels=kernels)

    @property
    def loaded_layers(self) -> int:
        """How many leading layers are loaded (`[0, loaded_layers)` can run)."""
        count = 0
        for layer in self.layers:
            if layer is None:
                break
            count += 1
        return count

    @property
    def fully_loaded(self) -> bool:
        return self.loaded_layers == self.config.num_layers and self.lm_head is not None

    def kv_layout(self, block_size: int = DEFAULT_KV_BLOCK_SIZE) -> PoolLayout:
        return kv_layout(self.config, block_size)

    def parameter_bytes(self) -> int:
        """Bytes of the weights loaded so far (a tied, unpacked output head is not counted twice)."""
        total = self.embed_tokens.numel() * self.embed_tokens.element_size()
        if self.final_norm is not None:
            total += self.final_norm.numel() * self.final_norm.element_size()
        head = self.lm_head
        if head is not None and (head.packed or head.weight.data_ptr() != self.embed_tokens.data_ptr()):
            total += head.nbytes
        return total + sum(layer.nbytes() for layer in self.layers if layer is not None)

    # ------------------------------------------------------------------ compute
    def check_token_ids(self, token_ids: torch.Tensor, what: str) -> None:
        if token_ids.numel() == 0:
            return
        low, high = int(token_ids.min()), int(token_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            bad = low if low < 0 else high
            raise TokenIdError(f"{what}: token id {bad} outside the vocabulary [0, {self.config.vocab_size})")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`[N]` int64 ids → `[N, hidden]` in the model dtype (ids must already be checked)."""
        return F.embedding(token_ids, self.embed_tokens)

    def check_layer_range(self, layers: range, *, head: bool = True) -> None:
        """Raise unless `layers` is a non-empty run of loaded layers (and, when it ends the model and
        `head` is true, the final norm and head are loaded too)."""
        if layers.step != 1 or layers.start < 0 or layers.stop > self.config.num_layers or len(layers) == 0:
            raise InvalidBatchError(
                f"layer range [{layers.start}, {layers.stop}) is not a non-empty part of "
                f"[0, {self.config.num_layers})"
            )
        for index in layers:
            if self.layers[index] is None:
                raise InvalidBatchError(f"layer {index} of {self.name!r} is not loaded yet")
        if (
            head
            and layers.stop == self.config.num_layers
            and (self.lm_head is None or self.final_norm is None)
        ):
            raise InvalidBatchError(f"the output head of {self.name!r} is not loaded yet")

    def run_layers(
        self,
        hidden: torch.Tensor,
        layers: range,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        ops: LayerOps | None = None,
    ) -> torch.Tensor:
        """Run `hidden` `[N, hidden]` through `layers`; `attend` reads and writes the paged KV cache.
        `ops`: whose kernels run the layer's pieces (default `self.ops`; the executor's kernel path
        passes its own, `replicas.model.ops`).

        Takes ownership of `hidden`: the residual stream is updated in place where the kernel allows
        (fewer large temporaries, which on CPU cost page faults); the result is returned.
        """
        config = self.config
        n_tokens = hidden.shape[0]
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        sizes = [config.q_size, config.kv_size, config.kv_size]
        eps = config.rms_norm_eps
        ops = ops or self.ops
        for index in layers:
            layer = self.layers[index]
            assert layer is not None
            x = ops.rms_norm(hidden, layer.input_norm, eps)
            q, k, v = ops.linear(layer.qkv, x).split(sizes, dim=-1)
            q = ops.rotary(q.view(n_tokens, heads, head_dim), cos, sin)
            k = ops.rotary(k.view(n_tokens, kv_heads, head_dim), cos, sin)
            attended = attend(q, k, v.view(n_tokens, kv_heads, head_dim), index)
            hidden = ops.add_linear(layer.o, hidden, attended)
            # SwiGLU: silu(gate(x)) * up(x), gate and up as one matrix product, activated in place
            gate, up = ops.linear(layer.gate_up, ops.rms_norm(hidden, layer.post_norm, eps)).chunk(2, dim=-1)
            hidden = ops.add_linear(layer.down, hidden, F.silu(gate, inplace=True).mul_(up))
        return hidden

    def logits(self, hidden: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """Final norm and output head on `[B, hidden]` rows → float32 `[B, vocab]`."""
        assert self.final_norm is not None and self.lm_head is not None
        ops = ops or self.ops
        normed = ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return ops.linear(self.lm_head, normed).float()
