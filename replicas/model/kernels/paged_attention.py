"""Paged attention in Triton: K/V written to and read from the cache through each sequence's block table.

Layout (the one of `replicas/model/kv_cache.py`): a layer's keys and values are each a tensor
`[num_blocks * block_size, kv_heads, head_dim]` in the model's dtype; token `t` of a sequence with block
table `ids` lives in row `ids[t // block_size] * block_size + t % block_size`. Keys are stored after
rotary embedding. Query head `h` reads KV head `h // (heads // kv_heads)` (GQA; MHA when they are equal).

The three entry points, each one kernel launch (this module gathers them; each lives in its own):
- `write_kv` (`kv_write`): the new tokens' K/V into their rows; a negative slot is skipped;
- `paged_decode_attention` (`paged_decode`): one query token per sequence, grid `(B, kv_heads)`, the
  query group of a KV head processed together so each K/V tile is read once per group;
- `paged_prefill_attention` (`paged_prefill`): packed variable-length new tokens with cached prefixes,
  grid `(cdiv(max_query_len, PREFILL_BLOCK_M), B, heads)`.

Invariants, for every entry point:
- Batch invariance: a sequence's output is bitwise the same whatever else shares the batch and whatever
  the batch size, padded rows included. Tile sizes are module constants or functions of head_dim alone
  (never of B, of a length, or of `max_query_len`), a program handles one sequence, the context is walked
  from position 0 upwards in one fixed order, and no context is split across programs (no split-KV).
  A change to any of these breaks the contract; `tests/model/kernels` checks it with `torch.equal`.
- CUDA-graph capture: `write_kv` and `paged_decode_attention` read no tensor value on the host; their
  grids depend on shapes only. Lengths, starts and slots are loaded in the kernels.
- Precision: loads are converted to float32 and all arithmetic is float32 (online softmax, flash-attention
  style). With float32 inputs both products run in IEEE float32 (never TF32); with 16-bit inputs they run
  in TF32 on a GPU, where Q·Kᵀ stays exact (a bfloat16/float16 value is a TF32 value) and P keeps 10
  mantissa bits. Outputs are stored in q's dtype.
- Only positions below a sequence's length are loaded (masked loads): rows past it in its last block, and
  block-table entries past its blocks, are never read, whatever they hold.

Not allowed: a tile size chosen from the batch, a split of one context over programs, a host read of a
tensor value in the decode or write path. In Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) the
same code runs, which is how the tests run without a GPU; there `tl.dot` on 16-bit tiles is wrong (Triton
3.9), one reason every dot here takes float32 tiles.
"""

from __future__ import annotations

from replicas.model.kernels.kv_write import write_kv
from replicas.model.kernels.paged_decode import paged_decode_attention
from replicas.model.kernels.paged_prefill import PREFILL_BLOCK_M, paged_prefill_attention

__all__ = ["PREFILL_BLOCK_M", "paged_decode_attention", "paged_prefill_attention", "write_kv"]
