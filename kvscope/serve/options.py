"""What one `kvscope serve` run does: its workload, and the bound on queued requests.

Torch-free, so the CLI reads the defaults without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# `kvscope serve --max-waiting`: requests waiting for admission (engine queue plus injected,
# not yet submitted) before new ones are refused. A control client can ask for 4,096 requests
# per message; without a bound a flood of bursts grows memory without end and slows every step.
DEFAULT_MAX_WAITING = 1024


@dataclass
class ServeOptions:
    workload: str = "mixed"
    num_requests: int | None = None
    seed: int = 0
    forever: bool = False
    burst_every_s: float | None = None  # forever mode: extra bursts on top of the workload
    step_clock_s: float | None = None  # forever mode: the workload's clock advances this much per engine step
    verbose_rejects: bool = True
    max_waiting: int | None = None  # None: no bound (a bench runs a finite list it made itself)
