"""Session-wide test settings.

Without a CUDA device the Triton kernels (`replicas/model/kernels/`) run in Triton's interpreter on CPU
tensors; it is chosen when a kernel is defined (at import), so it is set here, before any test module
imports one. A machine with a GPU runs the compiled kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
