"""The kvscope Textual app: one event source, one reducer, a ≤30 Hz repaint timer.

The source is any object with ``poll() -> list[Event]`` and a ``connection``
attribute (see ``kvscope.tui.sources``); live, replay and tests differ only in it.
Each tick drains the source, folds the events into the state with the reducer, and
repaints the widgets only if the state (or selection, palette, replay position)
changed, so a flood of events costs at most 30 repaints a second.
"""

from __future__ import annotations

import time
from typing import Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from kvscope.analysis.signals import StepLog
from kvscope.tui.palette import CB, DEFAULT, get_palette
from kvscope.tui.screens import (
    DashboardScreen,
    DiagnosisScreen,
    HelpScreen,
    LiveDashboard,
    ReplayDashboard,
    RequestDetailScreen,
    SeekScreen,
)
from kvscope.tui.screens.seek import seek_to
from kvscope.tui.sources import LiveSource, ReplayController
from kvscope.tui.state import (
    CONN_LIVE,
    new_state,
    note_local_drop,
    note_malformed,
    reduce,
    reset_stats,
    set_connection,
)
from kvscope.tui.widgets import QueueTable

MAX_FPS = 30.0
DIAGNOSIS_WINDOW = 2000  # steps the diagnosis panel judges


class KvscopeApp(App):
    CSS_PATH = "styles/app.tcss"
    TITLE = "kvscope"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("c", "toggle_palette", "Colours", show=False),
        Binding("r", "reset_stats", "Reset stats", show=False),
    ]

    def __init__(
        self,
        source,
        *,
        palette: str = "default",
        mode: str | None = None,
        fps: float = MAX_FPS,
        auto_tick: bool = True,
        address: str = "",
    ) -> None:
        super().__init__()
        self.source = source
        if mode is None:
            mode = "replay" if isinstance(source, ReplayController) else "live" if isinstance(source, LiveSource) else "feed"
        self.mode = mode
        self.replay: ReplayController | None = source if isinstance(source, ReplayController) else None
        self.pal = get_palette(palette)
        self.state = new_state(conn=getattr(source, "connection", "replay"))
        self.diagnosis_log = StepLog(window=DIAGNOSIS_WINDOW)  # the `d` panel's sliding window of steps
        self.selected: int | None = None
        self.address = address
        self.fps = min(MAX_FPS, max(1.0, fps))
        self.auto_tick = auto_tick
        self.engine_paused = False
        self.events_applied = 0
        self.repaints = 0
        self._drawn_key = None
        self._last_draw = 0.0
        self._error_shown: str | None = None
        self._notice_shown = ""

    # -- screens --------------------------------------------------------------------
    def get_default_screen(self) -> Screen:
        if self.mode == "replay":
            return ReplayDashboard()
        if self.mode == "live":
            return LiveDashboard()
        return DashboardScreen()

    def on_mount(self) -> None:
        self.pump()
        if self.auto_tick:
            self.set_interval(1.0 / self.fps, self.pump, name="kvscope-repaint")

    # -- the loop -------------------------------------------------------------------
    def pump(self) -> int:
        """Drain the source, reduce, repaint if anything changed. Returns events applied."""
        src = self.source
        events = src.poll()
        st = self.state
        log = self.diagnosis_log
        for ev in events:
            st = reduce(st, ev)
            log.add(ev)
        self.state = st
        self.events_applied += len(events)
        take = getattr(src, "take_local_dropped", None)
        if take is not None:
            note_local_drop(st, take())
        take_bad = getattr(src, "take_malformed", None)
        if take_bad is not None:
            n, last = take_bad()
            note_malformed(st, n, last)
        if st.notice and st.notice != self._notice_shown:
            self._notice_shown = st.notice
            self.notify(st.notice, severity="warning", timeout=10)
        set_connection(st, getattr(src, "connection", st.conn))
        replies = getattr(src, "take_replies", None)
        if replies is not None:
            for cmd, reply, quiet in replies():
                self._on_reply(cmd, reply, quiet)
        error = getattr(src, "error", None)
        if error and error != self._error_shown:
            self._error_shown = error
            self.notify(error, severity="error", timeout=15)
        if st.stale and st.conn == CONN_LIVE and hasattr(src, "request_snapshot"):
            src.request_snapshot()
        self.redraw()
        return len(events)

    def _on_reply(self, cmd: str, reply: dict, quiet: bool) -> None:
        if "paused" in reply:
            self.engine_paused = bool(reply["paused"])
        if quiet:
            return
        if reply.get("ok"):
            extra = ", ".join(f"{k} {v}" for k, v in reply.items() if k not in ("ok", "config"))
            self.notify(f"{cmd}: ok{' (' + extra + ')' if extra else ''}", timeout=2)
        else:
            self.notify(f"{cmd}: {reply.get('error', 'failed')}", severity="warning", timeout=3)

    def redraw(self, force: bool = False) -> None:
        st = self.state
        rp = self.replay
        rkey = None
        if rp is not None:
            s = rp.status()
            rkey = (s["playing"], s["done"], s["speed"], s["step"], round(s["t"], 2))
        key = (id(st), st.version, self.selected, self.pal.name, self.engine_paused, rkey, len(self.screen_stack))
        if not force and key == self._drawn_key:
            return
        now = time.monotonic()
        if self.auto_tick and now - self._last_draw < 1.0 / self.fps - 0.002:
            # Too soon after the last repaint: the next tick of the timer draws it.
            self._drawn_key = None
            return
        self._last_draw = now
        self._drawn_key = key
        for screen in self.screen_stack:
            show = getattr(screen, "show_state", None)
            if show is not None:
                show(st, self.pal, self.selected)
        self.repaints += 1

    # -- messages from widgets ------------------------------------------------------
    def on_queue_table_highlighted(self, message: QueueTable.Highlighted) -> None:
        if message.req is not None and message.req != self.selected:
            self.selected = message.req
            self.redraw()

    def on_queue_table_opened(self, message: QueueTable.Opened) -> None:
        self.selected = message.req
        self.push_screen(RequestDetailScreen(message.req))

    # -- actions --------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_diagnose(self) -> None:
        if not isinstance(self.screen, DiagnosisScreen):
            self.push_screen(DiagnosisScreen())

    def action_toggle_palette(self) -> None:
        self.pal = DEFAULT if self.pal is CB else CB
        self.redraw(force=True)

    def action_reset_stats(self) -> None:
        reset_stats(self.state)
        self.redraw(force=True)

    def action_control(self, cmd: str) -> None:
        request = getattr(self.source, "request", None)
        if request is None:
            self.notify("control needs a live engine", severity="warning", timeout=2)
            return
        request(cmd)

    def action_toggle_engine(self) -> None:
        self.action_control("resume" if self.engine_paused else "pause")

    def action_replay(self, name: str) -> None:
        rp = self.replay
        if rp is None:
            return
        result = getattr(rp, name)()
        if name == "next_preemption" and result is None:
            self.notify("no preemption after this step", timeout=2)
        self.pump()

    def action_seek_prompt(self, kind: str) -> None:
        if self.replay is None:
            return

        def done(target) -> None:
            if seek_to(self.replay, target):
                self.pump()

        self.push_screen(SeekScreen(kind), done)

    # -- command palette ------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Keys, glyphs and rules", self.action_help)
        yield SystemCommand("Diagnose", "The bottleneck of the recent steps, and the knobs to turn",
                            self.action_diagnose)
        yield SystemCommand("Toggle colour-blind palette", "Okabe-Ito colours on/off", self.action_toggle_palette)
        yield SystemCommand("Reset histograms", "Clear TTFT/ITL histograms and step history", self.action_reset_stats)
        if self.mode == "live":
            yield SystemCommand("Burst", "Inject a burst of requests", lambda: self.action_control("burst"))
            yield SystemCommand("Long prompt", "Inject one long prompt", lambda: self.action_control("long"))
            yield SystemCommand("Pause / resume engine", "Stop or restart scheduling", self.action_toggle_engine)
            yield SystemCommand("Snapshot now", "Resync the picture from a snapshot",
                                lambda: self.action_control("snapshot"))
        if self.replay is not None:
            yield SystemCommand("Play / pause", "Replay", lambda: self.action_replay("toggle"))
            yield SystemCommand("Seek to step…", "Jump to a step", lambda: self.action_seek_prompt("step"))
            yield SystemCommand("Seek to time…", "Jump to a trace time", lambda: self.action_seek_prompt("time"))
            yield SystemCommand("Next preemption", "Jump to the next step with a preemption",
                                lambda: self.action_replay("next_preemption"))
            yield SystemCommand("Faster", "Replay speed up", lambda: self.action_replay("faster"))
            yield SystemCommand("Slower", "Replay speed down", lambda: self.action_replay("slower"))
