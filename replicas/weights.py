"""The node's model: its resident shared copy, its host-memory copy, and what every replica loads from.

Replicas of one model in one process may share one resident copy of its weights (architecture §6).
`ModelHost.acquire` returns it, loading it piece by piece (off the event loop, progress reported per
piece) if no replica holds it; `release` drops a holder, and the resident copy is freed when the last one
goes (a replica moving to `Inactive`). Two replicas acquiring at once share one load.

The first load reads the checkpoint from disk and fills the node's host-memory copy
(`replicas.loading.host_copy`) on the way; it stays for the node's life, so later loads — a resident copy
loaded again, a replica's own copy with source `host` (`replicas.loading.copy`) — read no file. The
built-in `tiny` model is a checkpoint too: it is written once into the model cache
(`replicas.loading.tiny_checkpoint`) and read back like any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, final

import msgspec
import structlog
import torch
import trio

from replicas.loading.builder import ModelBuilder, ModelFrame
from replicas.loading.disk import DiskReader
from replicas.loading.host_copy import HostCopy
from replicas.loading.pieces import piece_bytes
from replicas.loading.progress import PieceLoaded
from replicas.loading.tiny_checkpoint import tiny_checkpoint, tiny_vision_seed
from replicas.model import ByteTokenizer, Model, ModelConfig, Tokenizer, read_hf_config
from replicas.model.checkpoint.loader import (
    check_checkpoint,
    checkpoint_tokenizer,
    generation_eos_ids,
    packs_tied_head,
)
from replicas.model.checkpoint.resolve import DEFAULT_CACHE_DIR, resolve_model
from replicas.model.config import ModelDType
from replicas.model.layers import LayerWeights
from replicas.model.text.chat_template import ChatTemplate, checkpoint_chat_template

_log = structlog.get_logger("replicas.weights")

Progress = Callable[[PieceLoaded], None]


@final
class ModelHost:
    """Loads `source` on demand; see the module docstring. `source` is `tiny`, a packaged model
    (`smollm2`), a `.gguf` file (converted once into `cache_dir`) or a checkpoint directory: see
    `replicas.model.checkpoint.resolve`. `checkpoint` is the directory every load reads.

    Cancellation: a cancelled `acquire` does not hold the model; a load in progress finishes in its
    worker thread (threads are never abandoned) and is kept for the next `acquire` if anyone waits.
    """

    def __init__(
        self,
        source: str,
        *,
        device: str,
        dtype: ModelDType | None,
        cache_dir: str = DEFAULT_CACHE_DIR,
        batch_invariant: bool = False,
    ) -> None:
        resolved = resolve_model(source, cache_dir=cache_dir)
        self._name = resolved.name
        self.source = "tiny" if resolved.directory is None else str(resolved.directory)
        self.device = device
        self.dtype = dtype
        self.cache_dir = cache_dir
        self.batch_invariant = batch_invariant
        self.config: ModelConfig = self._read_config()
        self._vision_seed: int | None = None
        self._pack_tied_head = True
        if resolved.directory is None:
            self.checkpoint = tiny_checkpoint(cache_dir)
            self._vision_seed = tiny_vision_seed(self.checkpoint)
        else:
            self.checkpoint = resolved.directory
            # Every tensor's presence and shape, from the file headers: a checkpoint that would fail its
            # first load stops the node at start-up instead of leaving every replica Inactive.
            check_checkpoint(self.checkpoint, self.config)
            self._pack_tied_head = packs_tied_head(self.checkpoint)
        self.tokenizer: Tokenizer | None = self._read_tokenizer()
        self.chat_template: ChatTemplate | None = self._read_chat_template()
        self._eos = () if self.source == "tiny" else generation_eos_ids(self.checkpoint)
        self._model: Model | None = None
        self._holders: set[str] = set()
        self._lock = trio.Lock()
        self._host_copy = HostCopy(self.config, pin=torch.device(device).type == "cuda")
        self.loads = 0
        self.copies = 0  # own weight copies started on this node (`replicas.loading`), from 1

    def next_copy(self) -> int:
        """Number the next own weight copy of a replica of this node (the `nth` of `hold_weights`)."""
        self.copies += 1
        return self.copies

    @property
    def name(self) -> str:
        return self._name

    @property
    def loaded(self) -> Model | None:
        return self._model

    @property
    def holders(self) -> frozenset[str]:
        return frozenset(self._holders)

    @property
    def host_copy(self) -> HostCopy | None:
        """The node's host-memory copy once complete (None before the first load finished)."""
        return self._host_copy if self._host_copy.complete else None

    def host_copy_to_fill(self) -> HostCopy | None:
        """The node's host copy while it is not complete: a load from disk fills it on the way."""
        return None if self._host_copy.complete else self._host_copy

    def frame(self) -> ModelFrame:
        """What a `Model` of this node is besides its weights (a copy's builder starts from it)."""
        return ModelFrame(
            config=self.config,
            device=torch.device(self.device),
            name=self._name,
            tokenizer=self.tokenizer,
            eos_token_ids=self._eos,
            vision_seed=self._vision_seed,
            batch_invariant=self.batch_invariant,
            pack_tied_head=self._pack_tied_head,
        )

    async def acquire(self, holder: str, progress: Progress | None = None) -> Model:
        """The loaded model, now held by `holder`. `progress` is called in the loading worker thread
        after each piece. Raises the loader's `ModelLoadError` on bad files."""
        async with self._lock:
            if self._model is None:
                self._model = await trio.to_thread.run_sync(self._load, progress)
                self.loads += 1
            self._holders.add(holder)
            return self._model

    def release(self, holder: str) -> None:
        """`holder` no longer serves the model; the last release frees the resident copy (the host copy
        stays)."""
        self._holders.discard(holder)
        if not self._holders:
            self._model = None

    def _read_config(self) -> ModelConfig:
        """The model's config as loaded: in the requested dtype (the loader converts the weights), so
        the KV pools built from it match the model."""
        if self.source == "tiny":
            from replicas.model import TINY_CONFIG

            config = TINY_CONFIG
        else:
            config = read_hf_config(self.source)
        return config if self.dtype is None else msgspec.structs.replace(config, dtype=self.dtype)

    def _read_tokenizer(self) -> Tokenizer | None:
        if self.source == "tiny":
            return ByteTokenizer(self.config.vocab_size)
        return checkpoint_tokenizer(Path(self.source))

    def _read_chat_template(self) -> ChatTemplate | None:
        if self.source == "tiny":
            from replicas.model.tiny import TINY_CHAT_TEMPLATE

            return ChatTemplate(TINY_CHAT_TEMPLATE, origin="the tiny model's chat template")
        return checkpoint_chat_template(self.source)

    def _load(self, progress: Progress | None) -> Model:
        """The resident copy, from the host copy when complete, else from disk (filling the host copy)."""
        host = self.host_copy
        source: Literal["host", "disk"] = "disk" if host is None else "host"
        builder = ModelBuilder(self.frame())
        reader = DiskReader(self.checkpoint, self.config)
        load_started = time.monotonic()
        try:
            for piece in builder.pieces:
                started = time.monotonic()
                tensors: dict[str, torch.Tensor] | LayerWeights
                fused = None if host is None or piece.layer is None else host.fused(piece.layer)
                if fused is not None:  # a CPU layer as the host copy keeps it: the same weights, shared
                    tensors = fused
                elif host is not None:
                    tensors = host.read(piece)
                else:
                    tensors = self._host_copy.put(piece, reader.read(piece))
                model = builder.add(piece, tensors)
                fused = None if piece.layer is None else model.layers[piece.layer]
                if piece.layer is not None and fused is not None:
                    self._host_copy.put_fused(piece.layer, fused)
                if progress is not None:
                    progress(
                        PieceLoaded(
                            piece=piece,
                            source=source,
                            bytes=piece_bytes(self.config, piece),
                            seconds=time.monotonic() - started,
                            loaded_layers=model.loaded_layers,
                            total_layers=self.config.num_layers,
                            bytes_loaded=model.parameter_bytes(),
                        )
                    )
        finally:
            reader.close()
        assert builder.model is not None and builder.done
        _log.info(
            "weights.loaded",
            model=self._name,
            source=source,
            bytes=builder.model.parameter_bytes(),
            seconds=round(time.monotonic() - load_started, 2),
            device=self.device,
        )
        return builder.model
