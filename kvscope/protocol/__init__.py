"""kvscope.protocol: the event schema (v1, msgspec Structs), its msgpack codec, the block-map
rule (:mod:`kvscope.protocol.blockmap`) and event sinks.

The ZeroMQ sockets live in :mod:`kvscope.protocol.pubsub` and :mod:`kvscope.protocol.control`
and are not imported here, so decoding events and reading traces work without pyzmq.
"""

from .codec import ProtocolError, decode, encode
from .events import *  # noqa: F401,F403
from .events import EVENT_TYPES, PROTOCOL_VERSION, EngineInfo, Event
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
    "EngineInfo",
    "RequestEvent",
    "RejectEvent",
    "StepEvent",
    "SnapshotEvent",
    "ByeEvent",
    "HeartbeatEvent",
    "BatchEntry",
    "Admission",
    "Preemption",
    "BlockAlloc",
    "RefChange",
    "FirstToken",
    "Finish",
    "ItlSample",
    "OutputText",
    "KvCounters",
    "PrefixHit",
    "Swap",
    "RequestState",
    "BlockOwner",
]
