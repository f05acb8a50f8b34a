"""`kvscope tui --vllm URL [--kv-events ADDR] [--kv-replay ADDR]`: a running vLLM's scheduler, from outside;
`kvscope replay FILE` of a `kvscope record --vllm` trace: the same view, moved by the player."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.tui.app import KvscopeApp


def run_vllm(url: str | None, kv_events: str | None, kv_replay: str | None, *, interval: float = 1.0,
             palette: str = "default") -> None:
    from kvscope.vllm.watch.source import VllmSource
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed

    source = VllmSource(url, kv_events, kv_replay, interval=interval).start()
    try:
        KvscopeApp([VllmFeed(source)], first="vllm", palette=palette).run()
    finally:
        source.close()


def make_vllm_replay_app(path: str, *, palette: str = "default", speed: float = 1.0, playing: bool = True,
                         start_step: int | None = None, auto_tick: bool = True) -> "KvscopeApp":
    """A recorded vLLM (`kvscope record --vllm`) in the vLLM view, on a player whose steps are its ticks."""
    from kvscope.vllm.watch.replay import VllmTraceSource
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import VllmFeed
    from kvscope.tui.model.player import Player

    source = VllmTraceSource(path)
    player = Player([source], speed=speed, playing=playing, clock=time.monotonic)
    if start_step is not None:
        player.seek(start_step)
    return KvscopeApp([VllmFeed(source)], player, "vllm", palette=palette, auto_tick=auto_tick)
