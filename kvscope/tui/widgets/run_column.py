"""One run's column on the compare screen: who it is, its queues, its KV map, its figures.

A RunColumn is a focusable container holding the dashboard's own BlockMap and
BatchView plus two small text widgets. It posts ``RunColumn.Opened`` when Enter asks
for the run's full dashboard.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message

from kvscope.tui import fmt
from kvscope.tui.sources.runs import Run, knob_text
from kvscope.tui.widgets.base import StateWidget, join_lines
from kvscope.tui.widgets.batch import BatchView
from kvscope.tui.widgets.blockmap import BlockMap
from kvscope.tui.widgets.queues import blocked_reason


def _pct(h, q: float) -> float | None:
    return h.quantile(q) if h is not None and getattr(h, "n", 0) else None


class RunHeader(StateWidget):
    """Label, mode and policy, the knobs that differ from the other runs, queue counts and heads."""

    def __init__(self, run: Run, knobs: list[str], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.run = run
        self.knobs = knobs
        self.focused = False

    def render(self) -> Text:
        pal = self.pal
        run = self.run
        width = max(10, self.size.width)
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f" {run.label} ", style=f"bold reverse {pal.ok}" if self.focused else "bold reverse")
        title.append(f" {run.name}", style="bold")
        lines = [title]
        if run.error:
            lines.append(Text(f" cannot read: {run.error}", style=f"bold {pal.bad}"))
            return join_lines(lines)
        knobs = Text(" ", no_wrap=True, overflow="ellipsis")
        shown = [k for k in self.knobs if k not in ("mode", "policy")]
        for i, key in enumerate(shown):
            if i:
                knobs.append(" · ", style=pal.dim)
            knobs.append(knob_text(key, run.config.get(key)), style=f"bold {pal.warn}")
        if not shown:
            only = " and ".join(k for k in ("mode", "policy") if k in self.knobs)
            knobs.append(f"only {only} differ{'s' if ' and ' not in only else ''}" if only else "same settings",
                         style=pal.dim)
        lines.append(knobs)
        st = self.state
        counts = Text(" ", no_wrap=True, overflow="ellipsis")
        if st is None:
            lines.append(counts)
            return join_lines(lines)
        counts.append(f"RUN {len(st.running)}", style="bold")
        counts.append(f"  WAIT {len(st.waiting)}", style="bold")
        counts.append(f"  PRE {len(st.preempted)}", style=f"bold {pal.warn}" if st.preempted else "bold")
        if st.step >= 0:
            counts.append(f"   step {st.step}", style=pal.dim)
        lines.append(counts)
        heads = Text(" ", no_wrap=True, overflow="ellipsis", style=pal.dim)
        if st.running:
            heads.append(f"run #{st.running[0]} ")
        reason = blocked_reason(st)
        if st.waiting:
            heads.append(f"wait #{st.waiting[0]}", style="")
            if reason:
                heads.append(f": {reason.split(': ', 1)[-1]}", style=pal.warn if "blocked" in reason else pal.dim)
        elif st.ended:
            heads.append(f"ended ({st.ended})")
        lines.append(heads)
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)


class RunNumbers(StateWidget):
    """TTFT and ITL p50/p99 so far, output tok/s since the first arrival, finished count."""

    def __init__(self, run: Run, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.run = run
        self.verdict: str | None = None

    def render(self) -> Text:
        pal = self.pal
        st = self.state
        width = max(10, self.size.width)
        if st is None or self.run.error:
            return Text("")
        lines = []
        for name, h in (("TTFT", st.ttft), ("ITL ", st.itl)):
            ln = Text(f" {name} ", style="bold", no_wrap=True)
            ln.append("p50 ", style=pal.dim)
            ln.append(f"{fmt.latency(_pct(h, 0.5)):>7}", style=pal.p50)
            ln.append("  p99 ", style=pal.dim)
            ln.append(f"{fmt.latency(_pct(h, 0.99)):>7}", style=pal.p99)
            lines.append(ln)
        origin = self.run.first_arrival or 0.0
        now = (st.last_batch.t + st.last_batch.dur) if st.last_batch else origin
        done, tokens = self.run.finished_by(now)
        elapsed = now - origin
        ln = Text(" tok/s ", style="bold", no_wrap=True)
        ln.append(f"{fmt.rate(tokens / elapsed if elapsed > 0 else 0.0):>5}")
        gp = st.goodput
        if gp is not None and gp.slo:  # the same span: tokens of good requests finished by now (docs/GOODPUT.md)
            ln.append("  good ", style="bold")
            ln.append(f"{fmt.rate(gp.good_tokens / elapsed if elapsed > 0 else 0.0)}")
        total = self.run.workload[0] if self.run.workload else 0
        ln.append(f"  done {done}/{total}", style=pal.dim)
        lines.append(ln)
        if self.verdict:
            lines.append(Text(f" ⚑ {self.verdict}", style=f"bold {pal.warn}", no_wrap=True))
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)


class RunColumn(Vertical, can_focus=True):
    """The column; Tab moves focus between columns, Enter opens this run's dashboard."""

    BINDINGS = [Binding("enter", "open", "Dashboard")]

    class Opened(Message):
        """Enter on a column: show this run's full dashboard at the same moment."""

        def __init__(self, column: "RunColumn", index: int) -> None:
            super().__init__()
            self.column = column
            self.index = index

    class Focused(Message):
        def __init__(self, column: "RunColumn", index: int) -> None:
            super().__init__()
            self.column = column
            self.index = index

    def __init__(self, run: Run, index: int, knobs: list[str], *, id: str | None = None) -> None:
        super().__init__(id=id, classes="run-column")
        self.run = run
        self.index = index
        self.knobs = knobs

    def compose(self) -> ComposeResult:
        yield RunHeader(self.run, self.knobs, id=f"run-header-{self.index}")
        yield BlockMap(id=f"run-map-{self.index}", title="KV")
        yield BatchView(id=f"run-batch-{self.index}")
        yield RunNumbers(self.run, id=f"run-numbers-{self.index}")

    def show(self, state, pal, selected=None) -> None:
        for w in self.query(StateWidget):
            w.show(state, pal, selected)

    def action_open(self) -> None:
        self.post_message(self.Opened(self, self.index))

    def on_focus(self) -> None:
        self.query_one(RunHeader).focused = True
        self.query_one(RunHeader).refresh()
        self.post_message(self.Focused(self, self.index))

    def on_blur(self) -> None:
        self.query_one(RunHeader).focused = False
        self.query_one(RunHeader).refresh()
