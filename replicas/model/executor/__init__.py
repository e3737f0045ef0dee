"""The batch-level API a replica calls: prefill (any layer range) and decode on one KV cache.

`Executor` (`executor`) runs a model against one replica's KV cache through one backend per path
(`backends`: eager, kernels, graphs); `batch` holds the sequences and results of its calls.
"""

from replicas.model.executor.batch import DecodeResult, DecodeSequence, PrefillResult, PrefillSequence
from replicas.model.executor.executor import Executor

__all__ = ["DecodeResult", "DecodeSequence", "Executor", "PrefillResult", "PrefillSequence"]
