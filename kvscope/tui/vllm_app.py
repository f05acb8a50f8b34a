"""`kvscope tui --vllm URL [--kv-events ADDR] [--kv-replay ADDR]`: a running vLLM's scheduler, from outside.

The VllmSource threads fill a VllmState under a lock; a 4 Hz timer copies what the
panels need and repaints them only when the state moved.
"""

from __future__ import annotations

import copy
import time

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kvscope.adapters.vllm_source import VllmSource
from kvscope.tui.palette import get_palette
from kvscope.tui.widgets import StateWidget
from kvscope.tui.widgets.vllm_panels import VllmCache, VllmHeader, VllmLatency, VllmQueues

TICK_S = 0.25
TOP_EVERY_S = 1.0


class VllmScreen(Screen):
    def compose(self) -> ComposeResult:
        yield VllmHeader(id="vllm-header")
        with Horizontal(id="vllm-body"):
            with Vertical(id="vllm-left"):
                yield VllmQueues(id="vllm-queues")
                yield VllmLatency(id="vllm-latency")
            yield VllmCache(id="vllm-cache")
        yield Footer(compact=True)


class VllmApp(App):
    CSS = """
    VllmHeader { height: 1; background: $panel; }
    #vllm-body { height: 1fr; }
    #vllm-left { width: 1fr; border-right: vkey $panel-lighten-2; }
    VllmQueues { height: 6; }
    VllmLatency { height: 1fr; }
    VllmCache { width: 1fr; }
    """
    TITLE = "kvscope · vLLM"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, source: VllmSource, *, palette: str = "default", auto_tick: bool = True) -> None:
        super().__init__()
        self.source = source
        self.pal = get_palette(palette)
        self.auto_tick = auto_tick
        self._drawn = -1
        self._top_at = 0.0

    def get_default_screen(self) -> Screen:
        return VllmScreen()

    def on_mount(self) -> None:
        self.pump()
        if self.auto_tick:
            self.set_interval(TICK_S, self.pump, name="kvscope-vllm")

    def pump(self) -> None:
        with self.source.lock:
            st = self.source.state
            if st.version == self._drawn:
                return
            self._drawn = st.version
            view = copy.copy(st)
            view.metrics = copy.copy(st.metrics)
            view.metrics.scrapes = type(st.metrics.scrapes)(st.metrics.scrapes, maxlen=st.metrics.scrapes.maxlen)
            view.kv = copy.copy(st.kv)
            view.cache = copy.copy(st.cache)
            view.cache.per_medium = copy.copy(st.cache.per_medium)
            view.cache._recent = copy.copy(st.cache._recent)
            now = time.monotonic()
            top = None
            if now - self._top_at >= TOP_EVERY_S:
                self._top_at = now
                top = st.cache.top_prefixes()
        for w in self.screen.query(StateWidget):
            if top is not None and isinstance(w, VllmCache):
                w.top = top
            w.show(view, self.pal, None)


def run_vllm(url: str | None, kv_events: str | None, kv_replay: str | None, *, interval: float = 1.0,
             palette: str = "default") -> None:
    source = VllmSource(url, kv_events, kv_replay, interval=interval).start()
    try:
        VllmApp(source, palette=palette).run()
    finally:
        source.close()
