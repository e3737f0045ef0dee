"""Loading HF checkpoint directories: `config.json`, `*.safetensors` (one file or sharded with
`model.safetensors.index.json`), `tokenizer.json`, `generation_config.json`.

Loading is layer by layer: `ModelLoader.steps()` fills the `Model` piece by piece (embeddings, then
each decoder layer, then the final norm and output head) and yields a `LoadProgress` after each, so a
replica can show progress and, later, serve the layers already loaded. Every tensor's shape is checked
against what `config.json` implies before it is read. No pickle: `.bin` checkpoints are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, final

import msgspec
import torch
from safetensors import SafetensorError, safe_open

from replicas.model.checkpoint.quantized import dequantize_stored, quantized_entries
from replicas.model.config import ModelConfig, ModelDType, read_hf_config
from replicas.model.errors import CheckpointError, WeightShapeError
from replicas.model.layers import expected_layer_shapes, fuse_layer
from replicas.model.linear import Kernels
from replicas.model.llama import Model
from replicas.model.text.tokenizer import HFTokenizer
from transport.memory.storage import torch_dtype

INDEX_FILE = "model.safetensors.index.json"


@final
@dataclass(frozen=True, slots=True)
class LoadProgress:
    stage: Literal["embeddings", "layer", "head"]
    layer: int | None
    loaded_layers: int
    total_layers: int
    bytes_loaded: int


EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@final
class CheckpointFiles:
    """Which safetensors file holds which tensor; opens files lazily; checks shapes before reading. A
    tensor a GGUF conversion kept quantized (`replicas.model.checkpoint.quantized`) is checked against
    the shape its file's metadata records and read dequantized, as float32."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._where: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        self._quantized: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
        index = directory / INDEX_FILE
        if index.is_file():
            self._read_index(index)
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in directory.glob("*.bin"))
                hint = f" ({', '.join(bins)} found; pickled .bin weights are not loaded)" if bins else ""
                raise CheckpointError(f"{directory}: no *.safetensors weight files{hint}")
            for path in files:
                for name in self._handle(path).keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    self._where[name] = path

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map: {exc!r}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be an object")
        for name, file_name in weight_map.items():
            path = self.directory / str(file_name)
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (listed in {INDEX_FILE} for tensor {name!r})")
            self._where[str(name)] = path

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from exc
            self._quantized[path] = quantized_entries(handle.metadata(), str(path))
            self._open[path] = handle
        return self._open[path]

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor `name`, after checking it exists and has `shape` (CPU, checkpoint dtype; float32 for
        one stored quantized)."""
        path = self.check(name, shape)
        tensor: torch.Tensor = self._handle(path).get_tensor(name)
        quantized = self._quantized[path].get(name)
        if quantized is not None:
            tensor = dequantize_stored(tensor, quantized[0], shape, f"{path.name}: tensor {name!r}")
        return tensor

    def stored_as_float32(self, name: str) -> bool:
        """Whether tensor `name` is stored as float32 (not 16-bit, not as quantized blocks)."""
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is in no safetensors file")
        handle = self._handle(path)
        return name not in self._quantized[path] and handle.get_slice(name).get_dtype() == "F32"

    def check(self, name: str, shape: tuple[int, ...]) -> Path:
        """The file holding tensor `name`, after checking from its header that it has `shape`."""
        path = self._where.get(name)
        if path is None:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is in no safetensors file")
        handle = self._handle(path)
        quantized = self._quantized[path].get(name)
        actual = quantized[1] if quantized is not None else tuple(handle.get_slice(name).get_shape())
        if actual != shape:
            raise WeightShapeError(
                f"{path.name}: tensor {name!r} has shape {list(actual)}, config.json implies {list(shape)}"
            )
        return path

    def close(self) -> None:
        self._open.clear()
        self._quantized.clear()


@final
class ModelLoader:
    """Builds a `Model` from a checkpoint directory piece by piece. `model` is usable for the layers
    loaded so far (see `Model.loaded_layers`). Validation of config and file list happens in `__init__`.
    `name` is the model's name (default: the directory's). `pack_tied_head` as in `Model`; None: as
    `packs_tied_head` decides for the checkpoint."""

    def __init__(
        self,
        directory: str | Path,
        *,
        dtype: ModelDType | None = None,
        device: str | torch.device = "cpu",
        kernels: Kernels = "auto",
        name: str | None = None,
        batch_invariant: bool = False,
        pack_tied_head: bool | None = None,
    ) -> None:
        if batch_invariant:
            kernels = "plain"
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a checkpoint directory (does not exist)")
        config = read_hf_config(self.directory)
        if dtype is not None:
            config = msgspec.structs.replace(config, dtype=dtype)
        self.config: ModelConfig = config
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        self.files = CheckpointFiles(self.directory)
        tokenizer = checkpoint_tokenizer(self.directory)
        self._outer = outer_tensor_shapes(config)
        if pack_tied_head is None:
            pack_tied_head = self.files.stored_as_float32(EMBED)
        self._embed = self._place(self.files.read(EMBED, self._outer[EMBED]))
        self.model = Model(
            config,
            device=self.device,
            embed_tokens=self._embed,
            tokenizer=tokenizer,
            eos_token_ids=generation_eos_ids(self.directory),
            name=name or self.directory.name,
            kernels=kernels,
            batch_invariant=batch_invariant,
            pack_tied_head=pack_tied_head,
        )
        self.kernels = kernels

    def steps(self) -> Iterator[LoadProgress]:
        """Load the rest, yielding after the embeddings, each layer and the head."""
        config = self.config
        yield LoadProgress("embeddings", None, 0, config.num_layers, self.model.parameter_bytes())
        shapes = expected_layer_shapes(config)
        for index in range(config.num_layers):
            prefix = f"model.layers.{index}."
            tensors = {name: self.files.read(prefix + name, shape) for name, shape in shapes.items()}
            self.model.set_layer(index, fuse_layer(tensors, self.dtype, self.device, kernels=self.kernels))
            yield LoadProgress("layer", index, index + 1, config.num_layers, self.model.parameter_bytes())
        norm = self._place(self.files.read(NORM, self._outer[NORM]))
        head = (
            self._embed
            if config.tie_word_embeddings
            else self._place(self.files.read(HEAD, self._outer[HEAD]))
        )
        self.model.set_head(norm, head)
        self.files.close()
        yield LoadProgress("head", None, config.num_layers, config.num_layers, self.model.parameter_bytes())

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()


def packs_tied_head(directory: Path) -> bool:
    """Whether a model of this checkpoint packs a tied output head (`Model.pack_tied_head`): where the
    checkpoint stores its embedding table as float32. One stored narrower (16-bit, GGUF blocks) was
    chosen for its memory: the table is then held once and the head multiplies with it."""
    files = CheckpointFiles(directory)
    try:
        return files.stored_as_float32(EMBED)
    finally:
        files.close()


def outer_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers and their shapes; `lm_head` only for an untied head."""
    shapes = {EMBED: (config.vocab_size, config.hidden_size), NORM: (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes[HEAD] = (config.vocab_size, config.hidden_size)
    return shapes


def checkpoint_tokenizer(directory: Path) -> HFTokenizer | None:
    """The checkpoint's `tokenizer.json` (None without one: prompts then come as token ids)."""
    path = directory / "tokenizer.json"
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a file")
    return HFTokenizer(path) if path.is_file() else None


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of `generation_config.json` (none without the file)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable as JSON: {exc}") from exc
    value = raw.get("eos_token_id") if isinstance(raw, dict) else None
    items = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise CheckpointError(f"{path}: eos_token_id must be an integer or a list of them, got {value!r}")
    return tuple(items)


def check_checkpoint(directory: str | Path, config: ModelConfig) -> None:
    """Check, from the safetensors headers alone (no weights read), that `directory` holds every tensor
    `config` needs in its shape, and that its generation config reads: what a load would find wrong,
    found at start-up instead of when a replica first loads. Raises `ModelLoadError`."""
    files = CheckpointFiles(Path(directory))
    try:
        for name, shape in outer_tensor_shapes(config).items():
            files.check(name, shape)
        for index in range(config.num_layers):
            for name, shape in expected_layer_shapes(config).items():
                files.check(f"model.layers.{index}.{name}", shape)
    finally:
        files.close()
    generation_eos_ids(Path(directory))


def load_model(
    directory: str | Path,
    *,
    dtype: ModelDType | None = None,
    device: str | torch.device = "cpu",
    progress: Callable[[LoadProgress], None] | None = None,
    kernels: Kernels = "auto",
    batch_invariant: bool = False,
    pack_tied_head: bool | None = None,
) -> Model:
    """Load a whole checkpoint (see `ModelLoader` to interleave serving with loading).

    `kernels` picks the projection kernels (see `replicas.model.linear.Kernels`); `batch_invariant` as in
    `Model`; `pack_tied_head` as in `ModelLoader`.
    """
    loader = ModelLoader(
        directory,
        dtype=dtype,
        device=device,
        kernels=kernels,
        batch_invariant=batch_invariant,
        pack_tied_head=pack_tied_head,
    )
    for step in loader.steps():
        if progress is not None:
            progress(step)
    return loader.model
