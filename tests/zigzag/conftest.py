"""Fixtures of the ZigZag tests: the tiny model as the node serves it."""

from __future__ import annotations

import pytest

from replicas.model import Model, tiny_model


@pytest.fixture(scope="session")
def tiny() -> Model:
    return tiny_model()
