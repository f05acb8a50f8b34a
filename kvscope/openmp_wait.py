"""OpenMP's wait policy, decided before torch loads libgomp (it reads OMP_WAIT_POLICY and GOMP_SPINCOUNT
once, then).

kvscope's threads spin briefly at a barrier, then sleep (GOMP_SPINCOUNT=20000, about a millisecond):
libgomp's default spins far longer and takes a core from any process beside it, and a passive wait
(no spin) made every op of a decode step wake its peer through the kernel, 1.75x slower for one
chat stream on 2 threads (docs/CPU.md, benchmarks/results/threads-wait-spin-*.json). Its own module, light
and outside the engine, so the command line can set it first thing without importing the engine
(`kvscope diagnose --no-what-if` loads no engine and no torch).
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
SPIN_COUNT_VAR = "GOMP_SPINCOUNT"
SPIN_COUNT = "20000"  # rounds of libgomp's spin loop, about a millisecond here; its default is 300000
_set_here: set[str] = set()  # the variables this process set, not the user: a peer's child gets the user's own


def prefer_short_spin_wait() -> None:
    """Make OpenMP's idle threads spin briefly, then sleep, unless the user chose (OMP_WAIT_POLICY or
    GOMP_SPINCOUNT); effective only before torch loads its OpenMP."""
    if "torch" not in sys.modules and WAIT_POLICY_VAR not in os.environ and SPIN_COUNT_VAR not in os.environ:
        os.environ[SPIN_COUNT_VAR] = SPIN_COUNT
        _set_here.add(SPIN_COUNT_VAR)


def user_environment() -> dict[str, str]:
    """This process's environment without the OpenMP settings kvscope chose for itself: what another program
    (llama.cpp, a peer in the bench) runs under, so it is measured under its own defaults, not ours."""
    return {k: v for k, v in os.environ.items() if k not in _set_here}
