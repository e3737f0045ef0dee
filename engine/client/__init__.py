"""The control-socket client: the `ControlClient` library and ``python -m engine.client``."""

from engine.client.control_client import (
    ControlClient,
    ControlClientError,
    ControlConnectionClosed,
    ControlError,
    ControlProtocolError,
)

__all__ = [
    "ControlClient",
    "ControlClientError",
    "ControlConnectionClosed",
    "ControlError",
    "ControlProtocolError",
]
