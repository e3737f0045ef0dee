"""The config section of how replicas run the model: `[executor]` (docs/gpu.md). Part of the node's one
config tree (`engine.config.NodeConfig`)."""

from __future__ import annotations

from typing import Annotated, Literal

from engine.config.base import Section, _doc


class ExecutorConfig(Section, frozen=True, kw_only=True):
    attention: Annotated[
        Literal["auto", "kernels", "torch"],
        _doc(
            "auto: the Triton paged-attention kernels on a GPU, torch's SDPA on CPU; kernels or torch "
            "everywhere"
        ),
    ] = "auto"
    cuda_graphs: Annotated[
        Literal["auto", "off"],
        _doc("auto: capture decode CUDA graphs per batch-size bucket when the kernels run on a GPU; off"),
    ] = "auto"
    batch_invariant: Annotated[
        bool,
        _doc(
            "matmuls, norms and attention whose result for a sequence does not depend on its batch, so "
            "the output is token-identical to the one-piece run in bfloat16 too (needs --device cuda)"
        ),
    ] = False
