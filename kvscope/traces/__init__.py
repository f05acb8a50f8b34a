"""Trace files (.kvtrace): writer, reader, replay clock. No torch, no zmq needed."""

from .reader import ChunkInfo, TraceReader
from .replay import ReplayClock
from .summary import TraceSummary
from .writer import TraceWriter

__all__ = [
    "TraceWriter",
    "TraceReader",
    "TraceSummary",
    "ChunkInfo",
    "ReplayClock",
]
