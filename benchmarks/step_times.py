"""Where a run's time goes, from its trace: each step's own duration (the engine's forward, sampling and
scheduling, as the scheduler saw it) beside the gap between a request's tokens (ITL) that clients see.

    python benchmarks/step_times.py run.kvtrace [more.kvtrace ...]

For each trace: steps that only decode, by batch size (count, median duration), steps with a prefill
chunk (median), the ITL samples' median, and the span of the busy steps against the trace's span.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvscope.protocol.events import StepEvent  # noqa: E402
from kvscope.traces.reader import TraceReader  # noqa: E402


def summary(path: str) -> str:
    steps = [e for e in TraceReader(path) if isinstance(e, StepEvent)]
    decode = defaultdict(list)
    prefill = []
    itl = []
    for s in steps:
        if not s.batch:
            continue
        if any(b.kind == "prefill" for b in s.batch):
            prefill.append(s.dur)
        else:
            decode[len(s.batch)].append(s.dur)
        itl.extend(x.gap for x in s.itl)
    busy = sum(s.dur for s in steps if s.batch)
    span = (steps[-1].t + steps[-1].dur - steps[0].t) if steps else 0.0
    lines = [f"{path}: {len(steps)} steps, busy {busy:.1f} s of {span:.1f} s"]
    for n in sorted(decode):
        d = decode[n]
        lines.append(f"  decode-only, batch {n:>3}: {len(d):>5} steps, median {statistics.median(d) * 1e3:7.1f} ms")
    if prefill:
        lines.append(f"  with a prefill chunk:     {len(prefill):>5} steps, median {statistics.median(prefill) * 1e3:7.1f} ms")
    if itl:
        lines.append(f"  ITL median {statistics.median(itl) * 1e3:.1f} ms over {len(itl)} samples")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summary(p))
