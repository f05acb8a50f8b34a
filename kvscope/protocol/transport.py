"""ZeroMQ transport, by its old name: events pub/sub (``pubsub``) and the control channel (``control``).

The two concepts live in their own modules; this one re-exports both so existing
imports keep working. pyzmq is imported lazily (on first socket).
"""

from __future__ import annotations

from .control import (
    CONTROL_COMMANDS,
    MAX_CONTROL_BYTES,
    MAX_CONTROL_WIRE_BYTES,
    ControlClient,
    ControlRequest,
    ControlServer,
    refused_reply,
    validate_control,
)
from .pubsub import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR, Subscriber, ZmqPublisher, check_bind_address
from .sinks import EventSink, FanOut

__all__ = [
    "DEFAULT_EVENTS_ADDR",
    "DEFAULT_CONTROL_ADDR",
    "CONTROL_COMMANDS",
    "MAX_CONTROL_BYTES",
    "MAX_CONTROL_WIRE_BYTES",
    "check_bind_address",
    "ZmqPublisher",
    "Subscriber",
    "ControlServer",
    "ControlRequest",
    "ControlClient",
    "EventSink",
    "FanOut",
    "refused_reply",
    "validate_control",
]
