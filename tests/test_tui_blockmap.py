"""The block map on screen equals the block table of the snapshot at that step."""

from __future__ import annotations

import asyncio

from fakes.sources import ListSource
from fakes.streams import sim_stream

from kvscope.tui.app import KvscopeApp
from kvscope.tui.palette import DEFAULT, owner_color
from kvscope.tui.model.state import new_state, reduce_all
from kvscope.tui.widgets import BlockMap
from kvscope.tui.widgets.blockmap import G_CACHED, G_FREE, G_SELECTED, G_SHARED, G_USED, cells_for


def expected_glyphs(snap, n_blocks: int, selected: int | None = None) -> list[tuple[str, int]]:
    """(glyph, owner) per block, straight from a snapshot."""
    by_block = {bo.block: bo for bo in snap.blocks}
    sel = set(snap.block_tables.get(selected, ())) if selected is not None else set()
    out = []
    for b in range(n_blocks):
        bo = by_block.get(b)
        if bo is None:
            out.append((G_FREE, -1))
        elif bo.refcount <= 0:
            out.append((G_CACHED, -1))
        elif b in sel:
            out.append((G_SELECTED, bo.req))
        else:
            out.append((G_SHARED if bo.refcount > 1 else G_USED, bo.req))
    return out


def snapshot_and_events_before(events, which: int):
    """The ``which``-th periodic snapshot and every event before it (not the snapshot)."""
    snaps = [i for i, ev in enumerate(events) if ev.type == "snapshot" and ev.step > 0]
    i = snaps[which]
    return events[i], events[:i]


def test_cells_equal_snapshot_blocks():
    events = sim_stream(600, seed=11, bursts=(50, 250), snapshot_every=40)
    for which in (2, 5, 9, 13):
        snap, before = snapshot_and_events_before(events, which)
        state = reduce_all(new_state(), before)  # built from deltas only
        assert state.step == snap.step
        n = len(state.blocks)
        k, cells = cells_for(state, capacity=10_000)
        assert k == 1
        assert [(c.glyph, c.owner) for c in cells] == expected_glyphs(snap, n)
        sel = snap.running[0]
        k, cells = cells_for(state, capacity=10_000, selected=sel)
        assert [(c.glyph, c.owner) for c in cells] == expected_glyphs(snap, n, sel)


def test_aggregation_says_how_many_blocks_per_cell():
    events = sim_stream(200, seed=2, num_blocks=500)
    state = reduce_all(new_state(), events)
    k, cells = cells_for(state, capacity=100)
    assert k == 5 and len(cells) == 100
    used = sum(1 for c in state.blocks.refcount if c > 0)
    assert used > 0
    # a cell is free only if all its k blocks are free
    for i, c in enumerate(cells):
        blocks = range(i * k, min(len(state.blocks), (i + 1) * k))
        any_used = any(state.blocks.refcount[b] > 0 for b in blocks)
        assert (c.glyph not in (G_FREE, G_CACHED)) == any_used


def test_rendered_map_equals_snapshot():
    """Pilot: the characters and colours drawn at step N are the snapshot's blocks."""
    events = sim_stream(400, seed=7, bursts=(60,), snapshot_every=50)
    snap, before = snapshot_and_events_before(events, 3)

    async def run():
        app = KvscopeApp(ListSource(before), auto_tick=False)
        async with app.run_test(size=(140, 44)) as pilot:
            await pilot.pause()
            await pilot.press("down")  # select the second running request
            await pilot.pause()
            bm = app.screen.query_one(BlockMap)
            text = bm.render()
            return app.state, app.selected, text, bm.size.width

    state, selected, text, width = asyncio.run(run())
    assert state.step == snap.step and selected == snap.running[1]
    lines = text.split("\n")
    assert "1 cell =" not in text.plain  # 96 blocks fit: one cell per block
    cols = width - 1
    drawn = []  # (glyph, colour) per block, read off the screen text
    for line in lines[1:]:
        plain = line.plain
        if not plain.strip() or plain.lstrip().startswith(("█used", "1 cell")):
            break
        for x in range(1, len(plain)):
            spans = [s for s in line.spans if s.start <= x < s.end]
            style = str(spans[-1].style) if spans else ""
            drawn.append((plain[x], style))
        if len(plain) - 1 < cols:
            break
    want = expected_glyphs(snap, len(state.blocks), selected)
    assert [g for g, _ in drawn] == [g for g, _ in want]
    for (g, style), (_, owner) in zip(drawn, want):
        if owner >= 0:
            assert owner_color(DEFAULT, owner) in style
