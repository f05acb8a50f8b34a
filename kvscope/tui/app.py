"""The one kvscope Textual app: feeds, an optional player, one ≤30 Hz timer, the first screen.

    KvscopeApp(feeds, player=None, first="dashboard" | "overview" | "compare" | "vllm" | "replicas")

Each tick the player (if any) moves its cursors, every feed folds what arrived
(``Feed.pump``: the one fold loop lives in ``feeds.base.EventFeed``), and the screens
repaint only if a feed, the player, the palette or a screen's own selection changed, so
a flood of events costs at most 30 repaints a second. Screens get their feeds and the
player in ``__init__`` and reach this App typed (``FeedView.kvscope``), never by probing.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Iterable, Literal, Sequence

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import ModalScreen, Screen

from kvscope.tui.feeds import DiagnosisUnavailable, EventFeed, Feed, LiveFeed, ReplayFeed, VllmFeed
from kvscope.tui.palette import CB, DEFAULT, get_palette
from kvscope.tui.model.player import Player
from kvscope.tui.screens import DashboardScreen, DiagnosisScreen, HelpScreen, LiveDashboard, ReplayDashboard
from kvscope.tui.screens.base import FeedView

MAX_FPS = 30.0
STARTUP_LOG_ENV = "KVSCOPE_STARTUP_LOG"  # a file: "first-draw T" and "first-step T" (unix times) are appended
First = Literal["dashboard", "overview", "compare", "vllm", "tour", "replicas"]
TITLES = {"dashboard": "kvscope", "overview": "kvscope · engines", "compare": "kvscope compare",
          "vllm": "kvscope · vLLM", "tour": "kvscope tour", "replicas": "kvscope · replicas"}


class KvscopeApp(App):
    CSS_PATH = ["styles/app.tcss", "styles/compare.tcss"]
    TITLE = "kvscope"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # a terminal's habit: no "press ctrl+q"
        Binding("question_mark", "help", "Help"),
        Binding("c", "toggle_palette", "Colours", show=False),
        Binding("r", "reset_stats", "Reset stats", show=False),
    ]

    def __init__(self, feeds: Sequence[Feed] | Any, player: Player | None = None, first: First = "dashboard", *,
                 palette: str = "default", fps: float = MAX_FPS, auto_tick: bool = True, address: str = "",
                 mode: str | None = None, notes: list[str] | None = None) -> None:
        """``feeds`` may also be one bare event source (a LiveSource, a ReplayController, any object with
        ``poll()`` and ``connection``): it gets the feed (and, for a trace, the player) it needs."""
        super().__init__()
        if not isinstance(feeds, (list, tuple)):
            feeds, player = _feeds_for(feeds, player, address=address)
        if not feeds:
            raise ValueError("the app needs at least one feed")
        if first not in TITLES:
            raise ValueError(f"first screen must be one of {', '.join(TITLES)}")
        self.feeds: list[Feed] = list(feeds)
        self._toasts: dict[str, Any] = {}  # key -> its last toast (Textual's Notification)
        self.player = player
        self.first = first
        self.live = mode == "live"  # a plain event feed shown with the live keys (tests, benches)
        self.notes = notes or []
        self.title = TITLES[first]
        self.pal = get_palette(palette)
        self.fps = min(MAX_FPS, max(1.0, fps))
        self.auto_tick = auto_tick
        self.events_applied = 0
        self.repaints = 0
        self._drawn_key = None
        self._last_draw = 0.0
        self._startup_log = os.environ.get(STARTUP_LOG_ENV) or None
        self._stepped = False
        self._fatal = False  # a LiveFeed's engine died: the app is exiting

    def _log_startup(self, what: str) -> None:
        """How long start-up took, measured from outside (docs/BENCHMARKS.md: start-up figures)."""
        if self._startup_log:
            with open(self._startup_log, "a", encoding="utf-8") as f:
                f.write(f"{what} {time.time():.6f}\n")

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The palette's "Screenshot", saved where the app was started (Textual's default is the desktop's
        Downloads folder, which a server or container rarely has), or in the temporary folder where that cannot
        be written. In a browser (`kvscope web`) it is downloaded, as Textual does."""
        if path is None:
            path = os.getcwd() if os.access(os.getcwd(), os.W_OK) else tempfile.gettempdir()
        return super().deliver_screenshot(filename, path, time_format)

    # -- what tests and benches read ----------------------------------------------------
    @property
    def state(self):
        """The first feed's reduced state (the dashboard's one engine)."""
        return self.feeds[0].state

    @property
    def states(self) -> list:
        return [f.state for f in self.feeds]

    @property
    def selected(self) -> int | None:
        """The request under the cursor on the screen shown (each screen keeps its own)."""
        screen = self.screen
        return screen.selected if isinstance(screen, FeedView) else None

    @property
    def engine_paused(self) -> bool:
        """Whether the engine on screen said it is paused."""
        screen = self.screen
        feed = screen.feed if isinstance(screen, FeedView) and screen.feed is not None else self.feeds[0]
        return feed.paused if isinstance(feed, EventFeed) else False

    def feed(self, name: str) -> Feed:
        return next(f for f in self.feeds if f.name == name)

    # -- screens --------------------------------------------------------------------
    def get_default_screen(self) -> Screen:
        feed = self.feeds[0]
        if self.first == "overview":
            from kvscope.tui.screens.overview import OverviewScreen

            return OverviewScreen(self.feeds)
        if self.first == "compare":
            from kvscope.tui.screens.compare import CompareScreen

            assert self.player is not None, "compare needs a player"
            return CompareScreen([f for f in self.feeds if isinstance(f, ReplayFeed)], self.player, self.notes)
        if self.first == "replicas":
            from kvscope.tui.screens.replicas import ReplicasScreen

            return ReplicasScreen([f for f in self.feeds if isinstance(f, EventFeed)])
        if self.first == "tour":
            from kvscope.tui.feeds.tour import TourFeed
            from kvscope.tui.screens.tour import TourScreen

            assert isinstance(feed, TourFeed), "the tour needs its feed"
            return TourScreen(feed, feed.driver)
        if self.first == "vllm" or isinstance(feed, VllmFeed):
            from kvscope.tui.screens.vllm import VllmReplayScreen, VllmScreen

            assert isinstance(feed, VllmFeed)
            return VllmReplayScreen(feed, self.player) if self.player is not None else VllmScreen(feed)
        assert isinstance(feed, EventFeed)
        if self.player is not None:
            return ReplayDashboard(feed, self.player)
        if isinstance(feed, LiveFeed) or self.live:
            return LiveDashboard(feed)
        return DashboardScreen(feed)

    def on_mount(self) -> None:
        if self.player is not None:
            self.player.start_clock()  # a replay or a compare opens at its start, not seconds into it
        self.pump()
        if self.auto_tick:
            self.set_interval(1.0 / self.fps, self.pump, name="kvscope-tick")

    def on_unmount(self) -> None:
        for feed in self.feeds:
            feed.close()

    # -- the loop -------------------------------------------------------------------
    def toast(self, text: str, *, severity: str = "information", timeout: float = 3.0, key: str = "") -> None:
        """notify(); with a key, the toast replaces the last one of that key (pressing b ten times: one toast)."""
        from textual.notifications import Notification, Notify

        old = self._toasts.pop(key, None) if key else None
        if old is not None:
            old.timeout = 0  # expired: gone at once, also if its Notify message is still on its way
            if old in self._notifications:
                self._unnotify(old)
        note = Notification(text, "", severity, timeout)  # type: ignore[arg-type]
        if key:
            self._toasts[key] = note
        self.post_message(Notify(note))

    def pump(self) -> int:
        """Move the player, fold what every feed got, repaint if anything changed. Returns events applied."""
        if self._fatal:
            return 0
        if self.player is not None:
            self.player.sync()
        now = time.monotonic()
        applied = 0
        for feed in self.feeds:
            applied += feed.pump(now)
            for n in feed.take_notices():
                self.toast(n.text, severity=n.severity, timeout=n.timeout, key=n.key)
            if isinstance(feed, LiveFeed) and feed.fatal:
                # the engine we started is gone: the caller raises its error. Exit once the screen is up
                # (an exit from the app's own on_mount would unmount the screen under its on_mount), and
                # draw nothing meanwhile: the screens are going away
                self._fatal = True
                self.call_after_refresh(self.exit)
                return applied
            if not self._stepped and isinstance(feed, EventFeed) and feed.state.steps_seen:
                self._stepped = True
                self._log_startup("first-step")
        self.events_applied += applied
        self.redraw()
        return applied

    def redraw(self, force: bool = False) -> None:
        pst = self.player.status() if self.player is not None else None
        rkey = (pst.playing, pst.done, pst.speed, pst.step, round(pst.t, 2), pst.indexing) if pst is not None else None
        screens = tuple((id(s), s.draw_key() if isinstance(s, FeedView) else None) for s in self.screen_stack)
        key = (tuple(f.version for f in self.feeds), rkey, self.pal.name, screens)
        if not force and key == self._drawn_key:
            return
        now = time.monotonic()
        if self.auto_tick and not force and now - self._last_draw < 1.0 / self.fps - 0.002:
            # Too soon after the last repaint: the next tick of the timer draws it.
            self._drawn_key = None
            return
        self._last_draw = now
        self._drawn_key = key
        for screen in reversed(self.screen_stack):  # the top screen, and what shows under a modal
            if isinstance(screen, FeedView):
                screen.draw(self.pal)
            if not isinstance(screen, ModalScreen):
                break
        self.repaints += 1
        if self.repaints == 1 and self._startup_log:
            self.call_after_refresh(self._log_startup, "first-draw")  # once it is on the terminal

    # -- what every screen can ask for ----------------------------------------------
    def open_diagnosis(self, feed: Feed) -> None:
        """The diagnosis panel of ``feed``, or one line saying why there is none."""
        if isinstance(self.screen, DiagnosisScreen):
            return
        try:
            feed.diagnose()
        except DiagnosisUnavailable as e:
            self.notify(str(e), severity="warning", timeout=4)
            return
        self.push_screen(DiagnosisScreen(feed))

    # -- actions --------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_palette(self) -> None:
        self.pal = DEFAULT if self.pal is CB else CB
        self.redraw(force=True)

    def action_reset_stats(self) -> None:
        for feed in self.feeds:
            feed.reset_stats()
        self.redraw(force=True)

    # -- command palette ------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Keys, glyphs and rules", self.action_help)
        yield SystemCommand("Toggle colour-blind palette", "Okabe-Ito colours on/off", self.action_toggle_palette)
        yield SystemCommand("Reset histograms", "Clear TTFT/ITL histograms and step history", self.action_reset_stats)
        if isinstance(screen, FeedView):
            for title, help_text, run in screen.commands():
                yield SystemCommand(title, help_text, run)


def _feeds_for(source: Any, player: Player | None, *, address: str = "") -> tuple[list[Feed], Player | None]:
    """The feed a bare source needs: a trace gets a ReplayFeed and a player on the trace's own clock."""
    from kvscope.tui.feeds.live import LiveSourceLike
    from kvscope.tui.sources.live import LiveSource
    from kvscope.tui.sources.replay import ReplayController

    if isinstance(source, ReplayController):
        if player is None:
            player = Player([source], speed=source.speed, playing=source.playing, clock=source.now)
            source.pause()  # the player keeps the time from here on
        return [ReplayFeed(source)], player
    if isinstance(source, LiveSource):
        return [LiveFeed(source, address=address or source.events_addr)], player
    if isinstance(source, LiveSourceLike):  # a wrapped or fake live source
        return [LiveFeed(source, address=address)], player
    return [EventFeed(source, address=address)], player
