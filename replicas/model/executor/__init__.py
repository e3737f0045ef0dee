"""The batch-level API a replica calls: prefill (any layer range) and decode on one KV cache.

`Executor` (`executor`) runs a model against one replica's KV cache through one backend per path
(`backends`: eager, kernels, graphs); `batch` holds the sequences and results of its calls; `logprobs`
scores tokens.
"""

from replicas.model.executor.batch import DecodeResult, DecodeSequence, PrefillResult, PrefillSequence
from replicas.model.executor.executor import Executor
from replicas.model.executor.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs

__all__ = [
    "MAX_TOP_LOGPROBS",
    "DecodeResult",
    "DecodeSequence",
    "Executor",
    "PrefillResult",
    "PrefillSequence",
    "TokenLogprobs",
]
