"""The vLLM view: a running vLLM's scheduler seen from outside (`kvscope tui --vllm URL`), or a
`kvscope record --vllm` trace played back with the player's keys (`kvscope replay FILE`).

The same screen is what the overview opens for a vLLM row. ``d`` asks the feed for its
diagnosis; a vLLM has none yet, so it says so in one line.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from kvscope.tui.screens.base import Command, FeedScreen
from kvscope.tui.screens.keys import REPLAY_KEYS, PlayerKeys
from kvscope.tui.widgets import StateWidget
from kvscope.tui.widgets.vllm_panels import VllmCache, VllmHeader, VllmLatency, VllmQueues

if TYPE_CHECKING:
    from kvscope.tui.feeds import VllmFeed
    from kvscope.tui.palette import Palette
    from kvscope.tui.model.player import Player

VLLM_CSS = """
VllmHeader { height: 1; background: $panel; }
#vllm-body { height: 1fr; }
#vllm-left { width: 1fr; border-right: vkey $panel-lighten-2; }
VllmQueues { height: 6; }
VllmLatency { height: 1fr; }
VllmCache { width: 1fr; }
"""


class VllmScreen(FeedScreen):
    DEFAULT_CSS = VLLM_CSS
    BINDINGS = [
        Binding("escape", "back", "Back", show=False),
        Binding("d", "diagnose", "Diagnose", show=False),
    ]

    def __init__(self, feed: "VllmFeed", player: "Player | None" = None) -> None:
        super().__init__()
        self.feed = feed
        self.player = player

    def compose(self) -> ComposeResult:
        yield VllmHeader(id="vllm-header")
        with Horizontal(id="vllm-body"):
            with Vertical(id="vllm-left"):
                yield VllmQueues(id="vllm-queues")
                yield VllmLatency(id="vllm-latency")
            yield VllmCache(id="vllm-cache")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.draw(self.kvscope.pal)

    def action_back(self) -> None:
        if len(self.kvscope.screen_stack) > 1:
            self.kvscope.pop_screen()

    def action_diagnose(self) -> None:
        self.kvscope.open_diagnosis(self.feed)

    def draw(self, pal: "Palette") -> None:
        feed = self.feed
        view = feed.view
        if view is None:
            return  # nothing pumped yet: the next tick draws
        if self.player is not None:
            view = replace(view, replay=feed.replay_position(self.player.status()))
        for w in self.query(StateWidget):
            if isinstance(w, VllmCache) and feed.top is not None:
                w.top = feed.top
            w.show(view, pal, None)


class VllmReplayScreen(PlayerKeys, VllmScreen):
    """A recorded vLLM, with the player's keys: ←/→ one recorder tick, shift+←/→ a tenth, Home/End."""

    BINDINGS = REPLAY_KEYS

    def __init__(self, feed: "VllmFeed", player: "Player") -> None:
        super().__init__(feed, player)
        self.player = player

    def commands(self) -> Iterable[Command]:
        yield from self.player_commands(preemption=False)
