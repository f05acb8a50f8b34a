"""Dashboard widgets; each renders from the shared TuiState."""

from kvscope.tui.widgets.base import StateWidget
from kvscope.tui.widgets.batch import BatchView
from kvscope.tui.widgets.blockmap import BlockMap
from kvscope.tui.widgets.header import HeaderBar
from kvscope.tui.widgets.latency import LatencyPanel
from kvscope.tui.widgets.queues import QueueTable
from kvscope.tui.widgets.replaybar import ReplayBar

__all__ = ["StateWidget", "BatchView", "BlockMap", "HeaderBar", "LatencyPanel", "QueueTable", "ReplayBar"]
