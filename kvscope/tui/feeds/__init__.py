"""Feeds: what the one App watches. A feed is a source, its reduced state, its stream health
and, for a live engine, the engine's controls.

- ``LiveFeed``: a kvscope engine over ZeroMQ, with its control channel (feeds/live.py)
- ``ReplayFeed``: a kvscope trace, moved by the player (feeds/replay.py)
- ``VllmFeed``: a vLLM's metrics and KV events, live or recorded (feeds/vllm.py)

Screens take feeds in ``__init__`` and draw from them; the App pumps every feed once a
tick. Nothing here imports textual.
"""

from kvscope.tui.feeds.base import (
    DiagnosisUnavailable,
    EngineControls,
    EngineRow,
    EventFeed,
    Feed,
    FeedHealth,
    Notice,
)
from kvscope.tui.feeds.live import LiveFeed
from kvscope.tui.feeds.replay import ReplayFeed
from kvscope.tui.feeds.vllm import VllmFeed

__all__ = ["DiagnosisUnavailable", "EngineControls", "EngineRow", "EventFeed", "Feed", "FeedHealth", "LiveFeed",
           "Notice", "ReplayFeed", "VllmFeed"]
