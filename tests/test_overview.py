"""The multi-engine overview: one row per engine, sort, filter, Enter to the engine's screen."""

from __future__ import annotations

import pytest

from tests.fakes.streams import ChunkedSource, drained_sim_stream


@pytest.fixture(scope="module")
def streams():
    return [drained_sim_stream(seed, requests=24 + 4 * seed, mode=("chunked", "continuous")[seed % 2]) for seed in range(4)]


def _feeds(streams, n):
    from kvscope.tui.feeds import LiveFeed

    return [LiveFeed(ChunkedSource(streams[i % len(streams)], per_poll=20 + i), name=f"engine-{i:02d}")
            for i in range(n)]


def _overview(feeds):
    from kvscope.tui.app import KvscopeApp

    return KvscopeApp(feeds, first="overview", auto_tick=False)


def _names(app):
    from textual.widgets import DataTable

    table = app.screen.query_one(DataTable)
    return [table.coordinate_to_cell_key((i, 0)).row_key.value for i in range(table.row_count)]


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.anyio
async def test_one_row_per_engine_at_80x24(streams, n):
    app = _overview(_feeds(streams, n))
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(3):
            app.pump()
            await pilot.pause()
        assert sorted(_names(app)) == [f"engine-{i:02d}" for i in range(n)]
        rows = [f.row() for f in app.feeds]
        assert all(r.setup in ("chunked · fcfs", "continuous · fcfs") for r in rows)
        assert any(r.running for r in rows) and all(r.kv_used is not None for r in rows)
        for feed, r in zip(app.feeds, rows):
            assert (r.running, r.waiting) == (len(feed.state.running), len(feed.state.waiting))
        title = str(app.screen.query_one("#overview-title").render())
        assert f"{n}/{n} engines" in title


@pytest.mark.anyio
async def test_sort_filter_and_open(streams):
    from kvscope.tui.screens.overview import EngineDashboard
    from kvscope.tui.widgets import BlockMap

    feeds = _feeds(streams, 16)
    app = _overview(feeds)
    async with app.run_test(size=(80, 24)) as pilot:
        for _ in range(4):
            app.pump()
        await pilot.pause()
        assert _names(app) == sorted(_names(app))
        await pilot.press("r")
        assert _names(app) == sorted(_names(app), reverse=True)
        await pilot.press("s", "s")  # by running, still largest first
        running = [app.feed(name).row().running for name in _names(app)]
        assert running == sorted(running, reverse=True)
        await pilot.press("slash")
        await pilot.press(*"engine-1", "enter")
        assert set(_names(app)) == {f"engine-{i:02d}" for i in range(10, 16)}
        await pilot.press("escape")
        assert len(_names(app)) == 16
        target = app.screen.selected_name()  # the cursor stays on its engine through filtering
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EngineDashboard) and app.screen.engine_name == target
        app.pump()
        await pilot.pause()
        assert app.screen.query_one(BlockMap).state is app.feed(target).state
        await pilot.press("b")
        assert app.feed(target).source.requests == ["burst"]
        await pilot.press("escape")
        assert not isinstance(app.screen, EngineDashboard)


@pytest.mark.anyio
async def test_a_vllm_row_beside_kvscope_rows(streams):
    from kvscope.vllm.watch.source import VllmSource
    from kvscope.tui.feeds import VllmFeed
    from kvscope.tui.screens.vllm import VllmScreen
    from tests.fakes.vllm import FakeMetricsServer

    server = FakeMetricsServer()
    server.running.set(9)
    server.waiting.set(4)
    server.kv.set(0.25)
    source = VllmSource(server.url)
    import httpx

    with httpx.Client() as client:
        source.scrape_once(client)
    feeds = _feeds(streams, 2) + [VllmFeed(source, name=server.url)]
    app = _overview(feeds)
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            app.pump()
            await pilot.pause()
            row = app.feed(server.url).row()
            assert (row.running, row.waiting, row.kv_used, row.connection) == (9, 4, 0.25, "live")
            app.screen.query_one("#overview-table").move_cursor(row=_names(app).index(server.url))
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, VllmScreen)
    finally:
        server.close()
