"""KV block map: one cell per block (or per k blocks), coloured by owning request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.text import Text

from kvscope.tui import fmt
from kvscope.tui.palette import owner_color
from kvscope.tui.widgets.base import StateWidget, join_lines

# Glyphs carry the block's kind, so colour is never the only cue.
G_USED, G_SHARED, G_CACHED, G_FREE, G_SELECTED = "█", "▒", "░", "·", "▣"
EIGHTHS = " ▁▂▃▄▅▆▇█"
KIND_FREE, KIND_CACHED, KIND_USED, KIND_SHARED = "free", "cached", "used", "shared"


@dataclass(slots=True)
class Cell:
    glyph: str
    owner: int  # -1 when no live owner
    kind: str
    selected: bool


def cells_for(state, capacity: int, selected: int | None = None) -> tuple[int, list[Cell]]:
    """Aggregate the block pool into at most ``capacity`` cells.

    Returns (k, cells): each cell stands for k consecutive blocks. With k == 1 a
    cell is one block: █ held by one request, ▒ shared (refcount > 1), ░ cached
    (free but holding a reusable prefix), · free, ▣ held by the selected request.
    With k > 1 the glyph's height is the fraction of the k blocks in use, the
    colour is the owner of most of them, ▒ marks a cell with a shared block and
    ▣ a cell holding a block of the selected request.
    """
    pool = state.blocks
    n = len(pool)
    if n == 0 or capacity <= 0:
        return 1, []
    k = max(1, math.ceil(n / capacity))
    owner, refc, cached = pool.owner, pool.refcount, pool.cached
    sel_blocks: set[int] = set()
    if selected is not None:
        sel_blocks = set(state.tables.get(selected, ()))
        sel_blocks.update(b for b in range(n) if owner[b] == selected and refc[b] > 0)
    cells: list[Cell] = []
    if k == 1:
        for b in range(n):
            rc = refc[b]
            if rc > 0:
                o = owner[b]
                if b in sel_blocks:
                    cells.append(Cell(G_SELECTED, o, KIND_SHARED if rc > 1 else KIND_USED, True))
                elif rc > 1:
                    cells.append(Cell(G_SHARED, o, KIND_SHARED, False))
                else:
                    cells.append(Cell(G_USED, o, KIND_USED, False))
            elif cached[b]:
                cells.append(Cell(G_CACHED, -1, KIND_CACHED, False))
            else:
                cells.append(Cell(G_FREE, -1, KIND_FREE, False))
        return 1, cells
    for start in range(0, n, k):
        end = min(n, start + k)
        used = shared = nc = 0
        counts: dict[int, int] = {}
        sel = False
        for b in range(start, end):
            rc = refc[b]
            if rc > 0:
                used += 1
                if rc > 1:
                    shared += 1
                o = owner[b]
                counts[o] = counts.get(o, 0) + 1
                if b in sel_blocks:
                    sel = True
            elif cached[b]:
                nc += 1
        span = end - start
        if used == 0:
            cells.append(Cell(G_CACHED if nc else G_FREE, -1, KIND_CACHED if nc else KIND_FREE, False))
            continue
        o = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        if sel:
            g = G_SELECTED
        elif shared:
            g = G_SHARED
        else:
            g = EIGHTHS[max(1, math.ceil(8 * used / span))]
        cells.append(Cell(g, o, KIND_SHARED if shared else KIND_USED, sel))
    return k, cells


class BlockMap(StateWidget):
    """Title with utilization and waste, the map, and a legend line."""

    def __init__(self, *, id: str | None = None, classes: str | None = None, title: str = "KV BLOCKS") -> None:
        super().__init__(id=id, classes=classes)
        self.title = title

    def stats(self) -> Text:
        st = self.state
        pal = self.pal
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" {self.title if self.size.width >= 50 else 'KV'} ", style="bold")
        if st is None:
            return t
        kv = st.kv
        total = kv.total or len(st.blocks)
        if total == 0:
            t.append(" no blocks yet", style=pal.dim)
            return t
        used = kv.used if kv.total else sum(1 for c in st.blocks.refcount if c > 0)
        t.append(f"{used}/{total} used ")
        util = used / total
        t.append(f"util {fmt.pct(util)} ", style=f"bold {pal.bad if util > 0.95 else pal.ok}")
        slots = used * st.block_size
        if slots:
            t.append(f"· tail waste {fmt.pct(kv.tail_waste / slots)} ", style=pal.dim if kv.tail_waste else "")
            if st.mode in ("naive", "static") or kv.reserve_waste:
                t.append(f"· reserved-unused {fmt.pct(kv.reserve_waste / slots)} ", style=f"bold {pal.warn}")
        if kv.shared:
            t.append(f"· shared {kv.shared} ", style=pal.dim)
        if kv.cached:
            t.append(f"· cached {kv.cached} ", style=pal.dim)
        if kv.query_tokens:
            t.append(f"· prefix hits {fmt.pct(kv.hit_tokens / kv.query_tokens)} ", style=pal.dim)
        if kv.swap_total:
            t.append(f"· swap {kv.swap_used}/{kv.swap_total} ", style=pal.warn if kv.swap_used else pal.dim)
        return t

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(8, self.size.width)
        height = max(1, self.size.height)
        lines = [self.stats()]
        map_rows = max(0, height - 2)
        if st is None or map_rows == 0:
            return join_lines(lines)
        cols = max(1, width - 1)
        k, cells = cells_for(st, cols * map_rows, self.selected)
        free_style = pal.free
        cached_style = pal.cached
        for r0 in range(0, len(cells), cols):
            row = Text(" ", no_wrap=True)
            run: list[str] = []
            run_style = None
            for c in cells[r0:r0 + cols]:
                if c.kind == KIND_FREE:
                    style = free_style
                elif c.kind == KIND_CACHED:
                    style = cached_style
                elif c.selected:
                    style = f"bold {pal.selected} on {owner_color(pal, c.owner)}"
                else:
                    style = owner_color(pal, c.owner)
                if style != run_style and run:
                    row.append("".join(run), style=run_style)
                    run = []
                run_style = style
                run.append(c.glyph)
            if run:
                row.append("".join(run), style=run_style)
            lines.append(row)
            if len(lines) >= height - 1:
                break
        legend = Text(" ", no_wrap=True, overflow="ellipsis", style=pal.dim)
        if k > 1:
            legend.append(f"1 cell = {k} blocks", style=f"bold {pal.warn}")
            legend.append(" │ ")
        legend.append(f"{G_USED}used {G_SHARED}shared {G_CACHED}cached {G_FREE}free {G_SELECTED}selected")
        while len(lines) < height - 1:
            lines.append(Text(""))
        lines.append(legend)
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines[:height])
