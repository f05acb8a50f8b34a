"""`kvscope tui --vllm URL [--kv-events ADDR] [--kv-replay ADDR]`: a running vLLM's scheduler, from outside;
`kvscope replay FILE` of a `kvscope record --vllm` trace: the same view, played back.

The VllmSource threads fill a VllmState under a lock; the screen's 4 Hz timer copies
what the panels need and repaints them only when the state moved. The same screen is
what the multi-engine overview opens for a vLLM row.
"""

from __future__ import annotations

import time

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kvscope.adapters.vllm_source import VllmSource
from kvscope.tui.palette import DEFAULT, get_palette
from kvscope.tui.widgets import StateWidget
from kvscope.tui.widgets.vllm_panels import VllmCache, VllmHeader, VllmLatency, VllmQueues

TICK_S = 0.25
TOP_EVERY_S = 1.0

VLLM_CSS = """
VllmHeader { height: 1; background: $panel; }
#vllm-body { height: 1fr; }
#vllm-left { width: 1fr; border-right: vkey $panel-lighten-2; }
VllmQueues { height: 6; }
VllmLatency { height: 1fr; }
VllmCache { width: 1fr; }
"""


class VllmScreen(Screen):
    DEFAULT_CSS = VLLM_CSS
    BINDINGS = [Binding("escape", "back", "Back", show=False)]

    def __init__(self, source: VllmSource, *, auto_tick: bool = True) -> None:
        super().__init__()
        self.source = source
        self.auto_tick = auto_tick
        self._drawn = -1
        self._top_at = 0.0

    def compose(self) -> ComposeResult:
        yield VllmHeader(id="vllm-header")
        with Horizontal(id="vllm-body"):
            with Vertical(id="vllm-left"):
                yield VllmQueues(id="vllm-queues")
                yield VllmLatency(id="vllm-latency")
            yield VllmCache(id="vllm-cache")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.pump()
        if self.auto_tick:
            self.set_interval(TICK_S, self.pump, name="kvscope-vllm")

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()

    def pump(self) -> None:
        widgets = list(self.query(StateWidget))
        if not widgets:
            return  # not composed yet: the next tick draws
        with self.source.lock:
            st = self.source.state
            if st.version == self._drawn:
                return
            self._drawn = st.version
            view = st.copy()
            now = time.monotonic()
            top = None
            if now - self._top_at >= TOP_EVERY_S:
                self._top_at = now
                top = st.cache.top_prefixes()
        pal = getattr(self.app, "pal", DEFAULT)
        for w in widgets:
            if top is not None and isinstance(w, VllmCache):
                w.top = top
            w.show(view, pal, None)


class VllmReplayScreen(VllmScreen):
    """The vLLM view over a recorded vLLM (adapters.vllm_replay.VllmTraceSource), with the player's keys."""

    BINDINGS = [
        Binding("space", "toggle", "Play/pause"),
        Binding("left", "seek(-0.1)", "Back 10%"),
        Binding("right", "seek(0.1)", "On 10%"),
        Binding("home", "restart", "Start", show=False),
        Binding("end", "to_end", "End", show=False),
        Binding("plus,equals_sign", "speed(2)", "Faster"),
        Binding("minus", "speed(0.5)", "Slower"),
    ]

    def action_toggle(self) -> None:
        self.source.toggle()
        self.pump()

    def action_seek(self, fraction: float) -> None:
        self.source.seek_by(fraction)
        self.pump()

    def action_restart(self) -> None:
        self.source.seek(self.source.first_step)
        self.pump()

    def action_to_end(self) -> None:
        self.source.seek(self.source.last_step)
        self.pump()

    def action_speed(self, factor: float) -> None:
        self.source.set_speed(factor)
        self.pump()


class VllmApp(App):
    TITLE = "kvscope · vLLM"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, source: VllmSource, *, palette: str = "default", auto_tick: bool = True) -> None:
        super().__init__()
        self.source = source
        self.pal = get_palette(palette)
        self.auto_tick = auto_tick

    def get_default_screen(self) -> Screen:
        screen = VllmReplayScreen if hasattr(self.source, "seek") else VllmScreen
        return screen(self.source, auto_tick=self.auto_tick)

    def pump(self) -> None:
        self.screen.pump()


def run_vllm(url: str | None, kv_events: str | None, kv_replay: str | None, *, interval: float = 1.0,
             palette: str = "default") -> None:
    source = VllmSource(url, kv_events, kv_replay, interval=interval).start()
    try:
        VllmApp(source, palette=palette).run()
    finally:
        source.close()


def make_vllm_replay_app(path: str, *, palette: str = "default", speed: float = 1.0, playing: bool = True,
                         start_step: int | None = None, auto_tick: bool = True) -> VllmApp:
    """A recorded vLLM (`kvscope record --vllm`) in the same view; the caller starts and closes its source."""
    from kvscope.adapters.vllm_replay import VllmTraceSource

    source = VllmTraceSource(path, speed=speed, playing=playing)
    if start_step is not None:
        source.seek(start_step)
    return VllmApp(source, palette=palette, auto_tick=auto_tick)
