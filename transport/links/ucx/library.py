"""Loading ucxx (the `ucx` extra) and the process's UCX context.

Importing zigzag never needs ucxx: `libucxx` imports it on first use, after setting what UCX reads as
its library loads. One context serves every worker of the process (`transport.links.ucx.worker`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Final, final

INSTALL_HINT: Final = "pip install 'zigzag[ucx]' (ucxx-cu12; ucxx-cu13 on CUDA 13 hosts)"


@final
class UcxUnavailable(Exception):
    """ucxx (the `ucx` extra) is not installed."""


@final
class UcxFailed(Exception):
    """A UCX operation failed: a request ended in error (cancelled, truncated), an address was unusable."""


def ucx_installed() -> bool:
    return importlib.util.find_spec("ucxx") is not None


@functools.cache
def libucxx() -> Any:
    """The ucxx core module, imported on first use: importing zigzag never needs ucxx."""
    if not ucx_installed():
        raise UcxUnavailable(f"the ucx transport needs ucxx, which is not installed: {INSTALL_HINT}")
    # UCX logs to stdout unless told otherwise, and stdout carries the node's listening line and the
    # benchmarks' JSON rows. UCX reads this when its library loads, so it can only be set here.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    # ucxx sets UCX_MEMTYPE_CACHE, which the UCX it bundles (1.21) no longer knows: every context would
    # warn about it on stderr.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as lib

    return lib


@functools.cache
def ucx_context() -> Any:
    """The process's UCX context (tag matching and wakeup), created once and kept: contexts are heavy.
    UCX reads its own `UCX_*` environment variables (e.g. `UCX_TLS`) here. Raises `UcxFailed` when UCX
    finds nothing to run on."""
    lib = libucxx()
    try:
        return lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
    except lib.UCXError as exc:  # not cached: a later call tries again
        raise UcxFailed(
            f"UCX could not start: {type(exc).__name__}: {exc} (no usable transport or device; UCX's log on "
            "stderr names the cause, e.g. a UCX_TLS listing transports this host lacks)"
        ) from exc


def cuda_transports_allowed(tls: str) -> bool:
    """Whether a `UCX_TLS` value lets UCX move CUDA memory itself (`all`, `cuda_copy`, `^tcp`, …)."""
    names = [name.strip() for name in tls.split(",") if name.strip()]
    if names and names[0].startswith("^"):
        excluded = [names[0][1:], *names[1:]]
        return not any(name in ("cuda", "cuda_copy") for name in excluded)
    return any(name == "all" or name.startswith("cuda") for name in names)
