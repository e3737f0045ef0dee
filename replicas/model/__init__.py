"""The model executor: a Llama/Qwen2 decoder in plain torch over a paged KV cache (see docs/model.md).

Public API (import from here):
- `Model` (shared weights), `tiny_model()`, `load_model()` / `ModelLoader` (HF checkpoints, layer by layer)
- `KVCache`, `kv_layout()` — the paged cache: a `BlockPool` plus `PoolStorage` with buffers `k{i}`, `v{i}`
- `Executor` with `PrefillSequence` / `DecodeSequence` — batched prefill (any layer range) and decode
- `SamplingParams`, `sample_tokens`, `finish_reason` — greedy and (seed, index)-determined sampling, with
  vLLM's penalties and logit bias over a sequence's `TokenHistory` (`token_history`)
- `VisionEncoder`, `ImageEmbedding`, `ImageGrid`, `layout_prompt` — images for the tiny model
- `generate_in_one_piece` — the reference output of a request
- `resolve_model()` — what a `--model` value names (`tiny`, `smollm2`, a `.gguf` file converted once into a
  cache, a checkpoint directory); `ChatTemplate` — a checkpoint's chat template, rendered as transformers does
- exceptions in `replicas.model.errors`
"""

from replicas.model.checkpoint.loader import LoadProgress, ModelLoader, load_model
from replicas.model.checkpoint.resolve import (
    DEFAULT_CACHE_DIR,
    PACKAGED_MODELS,
    ModelNotInstalledError,
    ModelSource,
    PackagedModel,
    convert_gguf,
    gguf_checkpoint,
    resolve_model,
)
from replicas.model.config import ModelConfig, RopeConfig, parse_hf_config, read_hf_config
from replicas.model.errors import (
    CheckpointError,
    ContextLengthError,
    ImageSizeError,
    InvalidBatchError,
    ModelError,
    ModelInputError,
    ModelLoadError,
    TokenIdError,
    UnsupportedModelError,
    WeightShapeError,
)
from replicas.model.executor import (
    MAX_TOP_LOGPROBS,
    DecodeResult,
    DecodeSequence,
    Executor,
    PrefillResult,
    PrefillSequence,
    TokenLogprobs,
)
from replicas.model.kv_cache import DEFAULT_KV_BLOCK_SIZE, KVCache, kv_layout, layer_buffer_names
from replicas.model.linear import Kernels, Linear
from replicas.model.llama import Model
from replicas.model.reference import generate_in_one_piece
from replicas.model.sampling import (
    GREEDY,
    LogitAdjustments,
    SamplingError,
    SamplingParams,
    TokenHistory,
    adjust_logits,
    finish_reason,
    sample_tokens,
    token_history,
    uniform_draw,
)
from replicas.model.text.chat_template import ChatTemplate, ChatTemplateError, checkpoint_chat_template
from replicas.model.text.prompt import IMAGE_PLACEHOLDER, PromptLayout, encode_prompt, layout_prompt
from replicas.model.text.tokenizer import ByteTokenizer, HFTokenizer, TextStream, Tokenizer
from replicas.model.tiny import TINY_CONFIG, tiny_model
from replicas.model.vision import (
    PATCH_SIZE,
    ImageEmbedding,
    ImageGrid,
    VisionEncoder,
    check_image,
    embedding_layout,
    embedding_rows,
    image_grid,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_KV_BLOCK_SIZE",
    "GREEDY",
    "IMAGE_PLACEHOLDER",
    "MAX_TOP_LOGPROBS",
    "PACKAGED_MODELS",
    "PATCH_SIZE",
    "TINY_CONFIG",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "CheckpointError",
    "ContextLengthError",
    "DecodeResult",
    "DecodeSequence",
    "Executor",
    "HFTokenizer",
    "ImageEmbedding",
    "ImageGrid",
    "ImageSizeError",
    "InvalidBatchError",
    "KVCache",
    "Kernels",
    "Linear",
    "LoadProgress",
    "LogitAdjustments",
    "Model",
    "ModelConfig",
    "ModelError",
    "ModelInputError",
    "ModelLoadError",
    "ModelLoader",
    "ModelNotInstalledError",
    "ModelSource",
    "PackagedModel",
    "PrefillResult",
    "PrefillSequence",
    "PromptLayout",
    "RopeConfig",
    "SamplingError",
    "SamplingParams",
    "TextStream",
    "TokenHistory",
    "TokenIdError",
    "TokenLogprobs",
    "Tokenizer",
    "UnsupportedModelError",
    "VisionEncoder",
    "WeightShapeError",
    "adjust_logits",
    "check_image",
    "checkpoint_chat_template",
    "convert_gguf",
    "embedding_layout",
    "embedding_rows",
    "encode_prompt",
    "finish_reason",
    "generate_in_one_piece",
    "gguf_checkpoint",
    "image_grid",
    "kv_layout",
    "layer_buffer_names",
    "layout_prompt",
    "load_model",
    "parse_hf_config",
    "read_hf_config",
    "resolve_model",
    "sample_tokens",
    "tiny_model",
    "token_history",
    "uniform_draw",
]
