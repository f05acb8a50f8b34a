"""kvscope.protocol: the event schema (v1), its msgpack codec and event sinks.

The ZeroMQ transport lives in :mod:`kvscope.protocol.transport` and is not imported
here, so decoding events and reading traces work without pyzmq.
"""

from .codec import ProtocolError, decode, encode
from .events import *  # noqa: F401,F403
from .events import EVENT_TYPES, PROTOCOL_VERSION, Event
from .sinks import EventSink, FanOut

__all__ = [
    "PROTOCOL_VERSION",
    "EVENT_TYPES",
    "Event",
    "ProtocolError",
    "encode",
    "decode",
    "EventSink",
    "FanOut",
    "HelloEvent",
    "RequestEvent",
    "RejectEvent",
    "StepEvent",
    "SnapshotEvent",
    "ByeEvent",
    "BatchEntry",
    "Admission",
    "Preemption",
    "BlockAlloc",
    "RefChange",
    "FirstToken",
    "Finish",
    "ItlSample",
    "KvCounters",
    "PrefixHit",
    "Swap",
    "RequestState",
    "BlockOwner",
]
