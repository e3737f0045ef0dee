"""Fixtures of the transfer tests that need an optional part: UCX (the `ucx` extra) or a GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from transport.links.ucx.library import ucx_installed

# CI runs the UCX tests on CPU over shared memory and TCP; a developer's own UCX_TLS wins.
UCX_TLS = "sm,tcp"


@pytest.fixture(scope="session")
def ucx_env() -> Iterator[dict[str, str]]:
    """Skip without ucxx; otherwise set `UCX_TLS` (unless already set) before this process makes its
    UCX context, and return the environment for child processes."""
    if not ucx_installed():
        pytest.skip("ucxx is not installed (pip install -e '.[ucx]')")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_TLS", os.environ.get("UCX_TLS", UCX_TLS))
        yield dict(os.environ)


@pytest.fixture
def cuda() -> torch.device:
    """The GPU tests' device; they skip without one, as in CI (`.ci/gpu` runs them on a GPU machine)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is false")
    return torch.device("cuda")
