"""Shared, read-only model weights: loaded once per node, held by the replicas that serve them.

Replicas of one model in one process share its weights (DESIGN §6). `ModelHost.acquire` returns the
loaded model, loading it layer by layer (off the event loop, progress reported per layer) if no replica
holds it; `release` drops a holder, and the weights are freed when the last one goes (a replica moving
to `Inactive`). Two replicas acquiring at once share one load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import final

import msgspec
import trio

from replicas.model import (
    ByteTokenizer,
    LoadProgress,
    Model,
    ModelConfig,
    ModelLoader,
    Tokenizer,
    read_hf_config,
    tiny_model,
)
from replicas.model.checkpoint.loader import check_checkpoint, checkpoint_tokenizer
from replicas.model.checkpoint.resolve import DEFAULT_CACHE_DIR, resolve_model
from replicas.model.config import ModelDType
from replicas.model.text.chat_template import ChatTemplate, checkpoint_chat_template

Progress = Callable[[LoadProgress], None]


@final
class ModelHost:
    """Loads `source` on demand; see the module docstring. `source` is `tiny`, a packaged model
    (`smollm2`), a `.gguf` file (converted once into `cache_dir`) or a checkpoint directory: see
    `replicas.model.checkpoint.resolve`.

    Cancellation: a cancelled `acquire` does not hold the model; a load in progress finishes in its
    worker thread (threads are never abandoned) and is kept for the next `acquire` if anyone waits.
    """

    def __init__(
        self, source: str, *, device: str, dtype: ModelDType | None, cache_dir: str = DEFAULT_CACHE_DIR
    ) -> None:
        resolved = resolve_model(source, cache_dir=cache_dir)
        self._name = resolved.name
        self.source = "tiny" if resolved.directory is None else str(resolved.directory)
        self.device = device
        self.dtype = dtype
        self.config: ModelConfig = self._read_config()
        if self.source != "tiny":
            # Every tensor's presence and shape, from the file headers: a checkpoint that would fail its
            # first load stops the node at start-up instead of leaving every replica Inactive.
            check_checkpoint(self.source, self.config)
        self.tokenizer: Tokenizer | None = self._read_tokenizer()
        self.chat_template: ChatTemplate | None = self._read_chat_template()
        self._model: Model | None = None
        self._holders: set[str] = set()
        self._lock = trio.Lock()
        self.loads = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def loaded(self) -> Model | None:
        return self._model

    @property
    def holders(self) -> frozenset[str]:
        return frozenset(self._holders)

    async def acquire(self, holder: str, progress: Progress | None = None) -> Model:
        """The loaded model, now held by `holder`. Raises the loader's `ModelLoadError` on bad files."""
        async with self._lock:
            if self._model is None:
                self._model = await trio.to_thread.run_sync(self._load, progress)
                self.loads += 1
            self._holders.add(holder)
            return self._model

    def release(self, holder: str) -> None:
        """`holder` no longer serves the model; the last release frees the weights."""
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
        if self.source == "tiny":
            model = tiny_model(dtype=self.dtype or "float32", device=self.device)
            if progress is not None:
                layers = model.config.num_layers
                progress(LoadProgress("head", None, layers, layers, model.parameter_bytes()))
            return model
        loader = ModelLoader(self.source, dtype=self.dtype, device=self.device, name=self._name)
        for step in loader.steps():
            if progress is not None:
                progress(step)
        return loader.model
