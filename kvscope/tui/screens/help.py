"""Help: keys for each mode and what the glyphs mean."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]kvscope[/b]: watch an LLM inference scheduler, one event per iteration.
  (↑ ↓ / pgup pgdn scroll this help; esc closes it)

[b]Everywhere[/b]
  tab / shift+tab   move between RUNNING, WAITING, PREEMPTED
  ↑ ↓ / j k         move the cursor; the request's KV blocks light up as ▣
  enter             request detail: lifecycle timeline and block table
  ?                 this help          ctrl+p  command palette
  c                 colour-blind-safe palette on/off
  r                 reset histograms   q / ctrl+c  quit
  d                 diagnosis: the bottleneck now, and the knob to turn

[b]Live[/b]  (kvscope tui / kvscope demo)
  b  burst of requests    l  one long prompt    space  pause/resume engine
  s  ask for a snapshot (resync)

[b]Replay[/b]  (kvscope replay FILE)
  space  play/pause       → / ←  one step forward / back
  g  seek to a step (type 12.5s for a time)    t  seek to a time
  p  next preemption      + / -  speed x0.1 … x100
  shift+← / →  a tenth of the run    shift+home / end  start / end

[b]Compare[/b]  (kvscope compare A B [C D], kvscope race)
  one column per run, one clock: the replay keys move every run; d diagnoses one
  tab / shift+tab   next / previous run     [ / ]  page when not all runs fit
  enter             the focused run's full dashboard at the same moment
  ★                 the best run for that figure in the summary strip

[b]Queues[/b]  chunks = prefill chunks done/total. Total is an estimate:
  done + ceil(prompt tokens left / chunk size) in chunked mode (chunk size =
  the token budget), one chunk otherwise; a recompute preemption restarts it.
  out/max = output tokens / max_tokens; age since arrival (engine clock);
  ttft once known; p = priority; ↺n = times preempted.
  The line under WAITING says why its head was not admitted this step.

[b]Block map[/b]  █ held by one request (colour = request)  ▒ shared
  ░ cached (free, still holds a prefix)  · free  ▣ the selected request.
  With more blocks than cells, 1 cell = k blocks: the glyph height is the
  share of them in use, the colour the request owning most of them.
  util = used / total blocks; tail waste = empty slots in the last, partly
  filled blocks; reserved-unused = slots reserved ahead (naive, static).

[b]Batch[/b]  █ prefill, ▓ decode, ░ padding against the budget; a column a step.
[b]Latency[/b]  log-scale histograms of TTFT and ITL with ▲ p50 ◆ p90 ● p99;
  tok/s sparkline over recent steps (engine clock; SIM = virtual clock).

[b]Header[/b]  ● live, ▶ replay, ○ disconnected (the last picture stays; the
  app resyncs from a snapshot when the engine is back). drop = events lost;
  STALE: steps were missed, the picture may be off until the next snapshot.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,question_mark,q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static(Text.from_markup(HELP), id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-body").focus()  # ↑ ↓ pgup pgdn scroll the help, however short the terminal

    def action_dismiss(self) -> None:
        self.dismiss(None)
