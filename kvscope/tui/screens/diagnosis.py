"""The diagnosis panel (key `d`): the bottleneck of the last steps seen, refreshed as events arrive.

It asks its feed to ``diagnose()``: a kvscope feed judges its sliding window of steps
(the ``StepLog`` its fold loop fills), so the panel reads the event stream only and
never runs the sim. A feed without a diagnosis (a vLLM, for now) raises
``DiagnosisUnavailable`` and the App shows that one line instead of the panel.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from kvscope.tui.screens.base import FeedModal

if TYPE_CHECKING:
    from kvscope.analysis.diagnose import Diagnosis
    from kvscope.tui.feeds import Feed
    from kvscope.tui.palette import Palette

REFRESH_S = 0.5  # judging a 2,000-step window takes milliseconds; twice a second is plenty


def render(d: "Diagnosis") -> Text:
    t = Text()
    t.append(f"bottleneck: {d.bottleneck}", style="bold")
    t.append(f"   score {d.score:g}   over the last {d.steps:,} steps\n\n")
    for e in d.evidence:
        t.append(f"  • {e.text}\n")
    if d.secondary:
        t.append("\nsecondary\n", style="bold")
        for i, r in enumerate(d.secondary, 1):
            t.append(f"  {i}. {r.bottleneck} ({r.score:g}): {r.evidence}\n")
    t.append("\nknobs\n", style="bold")
    if not d.knobs:
        t.append("  none: nothing for the scheduler to change\n")
    for i, k in enumerate(d.knobs, 1):
        t.append(f"  {i}. {k.flag} {k.from_} → {k.to}", style="bold")
        t.append(f"  {k.why}\n")
    for r in d.refusals:
        t.append(f"\n  refused: {r}\n", style="italic")
    t.append(f"\nmeasure next: {d.measure_next}\n")
    for x in d.cannot_judge:
        t.append(f"\n  could not judge: {x}", style="dim")
    t.append("\n\nkvscope diagnose TRACE checks each knob in the sim (what-if)", style="dim")
    return t


class DiagnosisScreen(FeedModal):
    BINDINGS = [Binding("escape,d,q", "app.pop_screen", "Close")]

    def __init__(self, feed: "Feed") -> None:
        super().__init__()
        self.feed = feed
        self._judged_at = float("-inf")

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="diagnosis-box"):
            yield Static("", id="diagnosis-body")

    def on_mount(self) -> None:
        title = f"DIAGNOSIS (d) · {self.feed.name}" if self.feed.name else "DIAGNOSIS (d)"
        self.query_one("#diagnosis-box").border_title = title
        self.refresh_diagnosis()

    def draw(self, pal: "Palette") -> None:
        if time.monotonic() - self._judged_at >= REFRESH_S:
            self.refresh_diagnosis()

    def diagnosis(self) -> "Diagnosis | None":
        return self.feed.diagnose()

    def refresh_diagnosis(self) -> None:
        self._judged_at = time.monotonic()
        d = self.diagnosis()
        body = self.query_one("#diagnosis-body", Static)
        body.update(render(d) if d is not None else Text("no steps yet: waiting for the engine to run"))
