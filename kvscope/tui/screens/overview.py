"""The overview: one row per engine (kvscope or vLLM), sortable and filterable; Enter opens its dashboard.

Keys: ``s`` sort by the next column, ``r`` reverse, ``/`` filter by name, ``escape``
clear the filter, ``d`` the diagnosis of the engine under the cursor, ``enter`` the
engine's full screen (its live dashboard, or the vLLM view), ``escape`` there to come
back. The table is rebuilt at most TABLE_HZ times a second, however many engines move.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Input, Static

from kvscope.tui import fmt
from kvscope.tui.feeds import EngineRow, EventFeed, Feed, VllmFeed
from kvscope.tui.screens.base import FeedScreen
from kvscope.tui.screens.dashboard import LiveDashboard
from kvscope.tui.widgets.latency import sparkline

if TYPE_CHECKING:
    from kvscope.tui.palette import Palette

TABLE_HZ = 4.0

# (title, key of EngineRow used for sorting)
COLUMNS = (("engine", "name"), ("setup", "setup"), ("run", "running"), ("wait", "waiting"), ("KV", "kv_used"),
           ("tok/s", "tok_per_s"), ("TTFT p99", "ttft_p99_s"), ("ITL p99", "itl_p99_s"), ("pre", "preemptions"),
           ("trend", None))
SORTABLE = [i for i, (_, key) in enumerate(COLUMNS) if key]


def _cell(v, f) -> str:
    return "-" if v is None else f(v)


def _tok_cell(r: EngineRow) -> str:
    """tok/s, and with an SLO the run's goodput beside it (docs/GOODPUT.md)."""
    text = _cell(r.tok_per_s, fmt.rate)
    return text if r.goodput_tok_per_s is None else f"{text} (good {fmt.rate(r.goodput_tok_per_s)})"


def row_cells(r: EngineRow, pal) -> list:
    dot = {"live": ("●", pal.ok), "replay": ("▶", pal.ok)}.get(r.connection, ("○", pal.bad))
    name = Text(f"{dot[0]} ", style=dot[1])
    name.append(r.name, style="bold")
    h = r.health
    if h is not None and (h.dropped or h.malformed or h.stale):  # the dashboard's header has the counts
        name.append(" ⚠", style=f"bold {pal.warn}")
    return [name, r.setup, _cell(r.running, str), _cell(r.waiting, str), _cell(r.kv_used, fmt.pct),
            _tok_cell(r), _cell(r.ttft_p99_s, fmt.dur), _cell(r.itl_p99_s, fmt.dur),
            _cell(r.preemptions, str), Text(sparkline(r.spark[-12:]), style=pal.bar)]


class OverviewScreen(FeedScreen):
    BINDINGS = [
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Reverse"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear", show=False),
        Binding("d", "diagnose", "Diagnose", show=False),
    ]

    def __init__(self, feeds: "list[Feed]") -> None:
        super().__init__()
        names = [f.name for f in feeds]
        if len(set(names)) != len(names):
            raise ValueError("engine names must be unique")
        self.feeds = {f.name: f for f in feeds}
        self._table_at = float("-inf")
        self.sort_col = 0
        self.descending = False
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        yield Static("", id="overview-title")
        yield DataTable(id="overview-table", cursor_type="row", zebra_stripes=True)
        yield Input(placeholder="filter engines by name (enter to apply, escape to clear)", id="overview-filter")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for title, _ in COLUMNS:
            table.add_column(title, key=title)
        self.query_one(Input).display = False
        table.focus()
        self._redraw()

    def visible_rows(self, rows: list[EngineRow]) -> list[EngineRow]:
        keep = [r for r in rows if self.filter_text.lower() in r.name.lower()]
        key = COLUMNS[self.sort_col][1]
        blank = "" if key in ("name", "setup") else 0
        keep.sort(key=lambda r: blank if getattr(r, key) is None else getattr(r, key), reverse=self.descending)
        keep.sort(key=lambda r: getattr(r, key) is None)  # stable: engines without the figure go last
        return keep

    def draw(self, pal: "Palette", force: bool = False) -> None:
        now = time.monotonic()
        if not force and self.kvscope.auto_tick and now - self._table_at < 1.0 / TABLE_HZ:
            return  # the next tick draws: a busy fleet costs TABLE_HZ table rebuilds a second
        self._table_at = now
        self.show_rows([f.row() for f in self.feeds.values()], pal)

    def _redraw(self) -> None:
        self.draw(self.kvscope.pal, force=True)

    def show_rows(self, rows: list[EngineRow], pal) -> None:
        tables = self.query(DataTable)
        if not tables or not tables.first().columns:
            return  # not mounted yet: the next tick draws
        table = tables.first()
        shown = self.visible_rows(rows)
        keep_cursor = None
        if table.row_count and 0 <= table.cursor_row < table.row_count:
            keep_cursor = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        table.clear()
        for r in shown:
            table.add_row(*row_cells(r, pal), key=r.name)
        if keep_cursor is not None:
            names = [r.name for r in shown]
            if keep_cursor in names:
                table.move_cursor(row=names.index(keep_cursor))
        title, _ = COLUMNS[self.sort_col]
        note = f"  filter: {self.filter_text!r}" if self.filter_text else ""
        self.query_one("#overview-title", Static).update(
            f" {len(shown)}/{len(rows)} engines · sorted by {title} {'↓' if self.descending else '↑'}{note}")

    def selected_name(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value

    def action_sort(self) -> None:
        i = SORTABLE.index(self.sort_col)
        self.sort_col = SORTABLE[(i + 1) % len(SORTABLE)]
        self._redraw()

    def action_reverse(self) -> None:
        self.descending = not self.descending
        self._redraw()

    def action_filter(self) -> None:
        box = self.query_one(Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    def action_clear_filter(self) -> None:
        self.filter_text = ""
        box = self.query_one(Input)
        box.display = False
        self.query_one(DataTable).focus()
        self._redraw()

    @on(Input.Submitted, "#overview-filter")
    def _apply_filter(self, event: Input.Submitted) -> None:
        self.filter_text = event.value.strip()
        event.input.display = False
        self.query_one(DataTable).focus()
        self._redraw()

    def selected_feed(self) -> "Feed | None":
        name = self.selected_name()
        return self.feeds.get(name) if name else None

    @on(DataTable.RowSelected)
    def _open(self, event: DataTable.RowSelected) -> None:
        feed = self.feeds.get(event.row_key.value)
        if isinstance(feed, VllmFeed):
            from kvscope.tui.screens.vllm import VllmScreen

            self.kvscope.push_screen(VllmScreen(feed))
        elif isinstance(feed, EventFeed):
            self.kvscope.push_screen(EngineDashboard(feed))

    def action_diagnose(self) -> None:
        feed = self.selected_feed()
        if feed is not None:
            self.kvscope.open_diagnosis(feed)


class EngineDashboard(LiveDashboard):
    """One kvscope engine's live dashboard, from the overview; escape goes back."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    @property
    def engine_name(self) -> str:
        return self.feed.name
