"""OpenMP's wait policy, decided before torch loads libgomp (it reads OMP_WAIT_POLICY once, then).

Idle OpenMP threads that spin take a core from any process beside them; passive ones sleep
(docs/CPU.md). Its own module, light and outside the engine, so the command line can set it first
thing without importing the engine (`kvscope diagnose --no-what-if` loads no engine and no torch).
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"


def prefer_passive_wait() -> None:
    """Make OpenMP's idle threads sleep rather than spin, unless the user chose; effective only before
    torch loads its OpenMP."""
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY_VAR, "PASSIVE")
