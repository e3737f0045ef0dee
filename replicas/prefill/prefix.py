"""A prompt's blocks in the prefix cache (architecture §4.1, docs/prefix-cache.md): its keys, what it
borrows before its prefill, and the prefill of the rest.

`PrefixLookup` is the prefill replica's side of its `PrefixCache`: `look` finds, without borrowing, the
longest cached prefix of a prompt's full blocks (a batch plan's input, `replicas.prefill.schedule.Borrow`)
and `borrow` takes it when the plan runs — at most all but the prompt's last token, which must run to
sample the first token; the prompt's prefill then starts after it, as a later chunk of a chunked
prefill does (the executor writes KV from `cached_tokens` on, attending to the blocks before). Its
computed blocks join the cache (`PrefixCache.publish`) once the whole prompt ran; its blocks go back
through `KVCache.release` when the request ends here, whoever holds it then.

A block's key (`transport.memory.prefix_cache.block_keys`) covers the model's identity (name, dtype,
kernels, config), its parent's key, its token ids and, from the block where an image's rows begin, the
digests of the request's images up to there (grid and landed embedding rows): an image changes the key
of every block from its own on.
"""

from __future__ import annotations

import hashlib
from typing import final

import torch

from replicas.model import ImageGrid, Model
from replicas.prefill.schedule import Borrow, PlanBroken
from replicas.request import ServingRequest
from transport.memory.prefix_cache import PrefixCache, block_keys

KEYS_KEPT = 256  # prompts whose keys a `PrefixLookup` keeps between plans


def model_identity(model: Model) -> bytes:
    """What makes two replicas' KV for the same tokens the same: the model, its dtype and its kernels."""
    text = f"{model.name}|{model.dtype}|{model.kernels}|{model.batch_invariant}|{model.config!r}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def image_digest(grid: ImageGrid, rows: torch.Tensor) -> bytes:
    """An image's digest: its patch grid and the embedding rows that landed for it (what its KV is
    computed from — an altered transfer gives another digest, never a wrong hit)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{grid.t}x{grid.h}x{grid.w}|{rows.dtype}".encode())
    digest.update(rows.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def image_extras(request: ServingRequest, block_size: int) -> list[bytes]:
    """Per full block: the digests of the images whose rows begin at or before its end (empty for a
    text request)."""
    if not request.images:
        return []
    embeds, indices = request.embeds, request.embed_indices
    if embeds is None or indices is None or len(request.image_grids) != len(request.images):
        raise ValueError(f"request {request.request_id}: its images are not laid out yet")
    indices = torch.as_tensor(indices, dtype=torch.int64)
    starts: list[int] = []
    digests: list[bytes] = []
    row = 0
    for grid in request.image_grids:
        starts.append(int(indices[row]) if grid.rows else 0)
        digests.append(image_digest(grid, embeds[row : row + grid.rows]))
        row += grid.rows
    extras = []
    for index in range(request.prompt_tokens // block_size):
        end = (index + 1) * block_size
        extras.append(b"".join(d for d, start in zip(digests, starts) if start < end))
    return extras


def prompt_keys(request: ServingRequest, model: bytes, block_size: int) -> list[bytes]:
    """The keys of the full blocks of `request`'s laid-out prompt."""
    return block_keys(model, request.token_ids, block_size, image_extras(request, block_size))


def routing_keys(request: ServingRequest, model: Model, block_size: int) -> list[bytes]:
    """The keys of `request`'s full prompt blocks as far as they are known before its images are laid
    out: every full block of a text prompt; of an image request, the blocks before its first image
    (they hold no image rows, so their keys are the ones its prefill replica will compute)."""
    ids = request.token_ids if request.prompt_ready else request.prompt_ids
    image_token = model.config.image_token_id
    if request.has_images and image_token is not None:
        ids = ids[: ids.index(image_token)] if image_token in ids else ids
    return block_keys(model_identity(model), ids, block_size)


@final
class PrefixLookup:
    """See the module docstring."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        # A text prompt's keys by request id (its tokens never change), under the model they were hashed
        # for: a prompt that waits for room is planned again every pass, and hashing a long prompt costs
        # milliseconds. Forgotten when
        # it borrows, or oldest first beyond `KEYS_KEPT` (a request that left unstarted).
        self._keys: dict[str, tuple[bytes, tuple[bytes, ...]]] = {}
        self._identity: tuple[Model, bytes] | None = None

    def look(self, request: ServingRequest, model: Model, *, share: bool = True) -> Borrow:
        """What `request`'s prompt would borrow of the cache now, nothing borrowed (a plan's input): at
        most all but its last token; `share` false: nothing (a prompt whose every row must run, to score
        its tokens), but its full blocks' keys still go with it, so that its computed blocks join."""
        cache = self.cache
        if not cache.enabled:
            return Borrow(keys=(), blocks=(), idle=frozenset(), counted=share)
        block_size = cache.pool.block_size
        keys = self._prompt_keys(request, model, block_size)
        limit = (request.prompt_tokens - 1) // block_size if share else 0
        blocks, idle = cache.peek(keys, limit=limit)
        return Borrow(keys=keys, blocks=tuple(blocks), idle=frozenset(idle), counted=share)

    def _prompt_keys(self, request: ServingRequest, model: Model, block_size: int) -> tuple[bytes, ...]:
        if self._identity is None or self._identity[0] is not model:
            self._identity = (model, model_identity(model))
        identity = self._identity[1]
        if request.images:  # its keys hold its landed embeddings' digests: hashed again each time
            return tuple(prompt_keys(request, identity, block_size))
        kept = self._keys.get(request.request_id)
        if kept is not None and kept[0] == identity:
            return kept[1]
        keys = tuple(prompt_keys(request, identity, block_size))
        self._keys[request.request_id] = (identity, keys)
        if len(self._keys) > KEYS_KEPT:
            del self._keys[next(iter(self._keys))]
        return keys

    def borrow(self, request_id: str, borrow: Borrow) -> list[int]:
        """Borrow what `look` found for `request_id` (a plan's decision), and remember its full blocks'
        keys for `publish` and `release`; returns the blocks. Raises `PlanBroken` when the cache no
        longer holds them (the plan was made against another cache: only a bug gets here)."""
        self._keys.pop(request_id, None)
        if not self.cache.enabled:
            return []
        blocks = self.cache.acquire(request_id, borrow.keys, limit=len(borrow.blocks))
        if tuple(blocks) != borrow.blocks:
            self.cache.release(request_id, blocks)
            raise PlanBroken(
                f"request {request_id}: the plan borrows cached blocks {list(borrow.blocks)}, "
                f"the prefix cache holds {blocks}"
            )
        return blocks

    def counted(self, request: ServingRequest, cached_tokens: int) -> None:
        """`request` started with `cached_tokens` from the cache: count it (Prometheus, `status`)."""
        self.cache.queried_tokens += request.prompt_tokens
        self.cache.hit_tokens += cached_tokens
