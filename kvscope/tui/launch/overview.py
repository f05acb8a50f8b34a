"""`kvscope tui --connect A --connect B ... [--vllm URL ...]`: many engines, one row each, on the overview
screen of the one App. Every kvscope engine is a LiveFeed, so its drops, malformed frames, stale
snapshots and pause state are kept exactly as in a single-engine dashboard."""

from __future__ import annotations


def run_overview(kvscope: list[tuple[str, str | None]], vllm: list[tuple[str, str | None, str | None]], *,
                 interval: float = 1.0, palette: str = "default") -> None:
    """kvscope: (events addr, control addr or None); vllm: (url, kv events addr, kv replay addr)."""
    from kvscope.vllm.watch.source import VllmSource
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed, VllmFeed
    from kvscope.tui.sources.live import LiveSource

    feeds: list = []
    for addr, control in kvscope:
        feeds.append(LiveFeed(LiveSource(addr, control), name=addr, address=addr))
    for url, kv, replay in vllm:
        feeds.append(VllmFeed(VllmSource(url, kv, replay, interval=interval).start(), name=url))
    KvscopeApp(feeds, first="overview", palette=palette).run()
