"""Fixtures of the EPD tests (docs/epd.md): the tiny model as the node serves it."""

from __future__ import annotations

import pytest

from replicas.model import Model, tiny_model


@pytest.fixture(scope="session")
def tiny() -> Model:
    """The node's `tiny` model, built here the same way (same seed, same weights)."""
    return tiny_model()
