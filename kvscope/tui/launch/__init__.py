"""App entry points used by ``kvscope tui`` and ``kvscope replay`` (``kvscope demo``: tui/launch/demo.py).

Textual is imported only inside these functions, so importing this module is cheap.
"""

from __future__ import annotations

import sys

from kvscope.errors import KvscopeError
from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR


def run_live(events_addr: str = DEFAULT_EVENTS_ADDR, control_addr: str | None = DEFAULT_CONTROL_ADDR,
             palette: str = "default", *, starting=None, slo=None) -> None:
    """Watch a live engine. Survives the engine starting later, exiting and restarting.

    ``starting`` (feeds.live.EngineStarting): an engine this view started; the header shows its
    progress until its first step, and if it dies first the app ends with its error (KvscopeError)."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed
    from kvscope.tui.sources.live import LiveSource

    source = LiveSource(events_addr, control_addr)
    feed = LiveFeed(source, address=events_addr, starting=starting, slo=slo)
    try:
        KvscopeApp([feed], palette=palette).run()
    finally:
        source.close()
    if feed.fatal:
        raise KvscopeError(feed.fatal)


def make_replicas_app(ranks: list[tuple[str, str | None]], *, palette: str = "default", slo=None, **kw):
    """The ranks of a data-parallel deployment side by side, a LiveFeed each: (events addr, control addr)."""
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed
    from kvscope.tui.sources.live import LiveSource

    feeds = [LiveFeed(LiveSource(events, control), name=events, address=events, slo=slo) for events, control in ranks]
    return KvscopeApp(feeds, first="replicas", palette=palette, **kw)


def run_replicas(ranks: list[tuple[str, str | None]], *, palette: str = "default", slo=None) -> None:
    make_replicas_app(ranks, palette=palette, slo=slo).run()


def make_replay_app(path: str, *, palette: str = "default", speed: float = 1.0, playing: bool = True,
                    start_step: int | None = None, clock=None, auto_tick: bool = True,
                    index_in_background: bool = True, slo=None):
    """The app replaying a trace file (also used by the screenshots script): a ReplayFeed and its player,
    or, for a recorded vLLM, the vLLM view on the same player. The steps are indexed in the background
    once the first frame is drawn (tui/model/step_index.py), so opening a trace costs its start only."""
    import os
    import time

    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import ReplayFeed
    from kvscope.tui.model.player import Player
    from kvscope.tui.sources.replay import ReplayController, open_trace

    trace = open_trace(path)
    if trace.vllm_recording:
        from kvscope.tui.launch.vllm import make_vllm_replay_app

        return make_vllm_replay_app(path, palette=palette, speed=speed, playing=playing, start_step=start_step,
                                    auto_tick=auto_tick)
    clock = clock or time.monotonic
    cursor = ReplayController(trace, playing=False, clock=clock, index_in_background=index_in_background, slo=slo)
    player = Player([cursor], speed=speed, playing=playing, clock=clock)
    if start_step is not None:
        player.seek(start_step)
    return KvscopeApp([ReplayFeed(cursor, name=os.path.basename(path), slo=slo)], player, palette=palette,
                      auto_tick=auto_tick)


def run_replay(path: str, palette: str = "default", *, speed: float = 1.0, start_step: int | None = None,
               paused: bool = False, slo=None) -> None:
    """Replay a .kvtrace file through the same screens as live. A file that is not a readable trace
    is a KvscopeError (one line, exit status 2 from the CLI); a damaged one replays up to the damage."""
    from kvscope.protocol.codec import ProtocolError

    try:
        app = make_replay_app(path, palette=palette, speed=speed, playing=not paused, start_step=start_step, slo=slo)
    except OSError as e:
        raise KvscopeError(f"cannot read {path}: {e.strerror or e}") from None
    except ProtocolError as e:
        raise KvscopeError(f"cannot replay {path}: {e}") from None
    for feed in app.feeds:
        for w in feed.source.trace.warnings or ():
            print(f"kvscope replay: warning: {w}", file=sys.stderr)
    app.run()
    for feed in app.feeds:  # damage the background index found past what was played
        index = getattr(feed.source, "index", None)
        for w in (index.warnings if index is not None else ()):
            if w not in (feed.source.trace.warnings or ()):
                print(f"kvscope replay: warning: {w}", file=sys.stderr)
