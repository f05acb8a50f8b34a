"""Child processes kvscope starts and must not leave behind (an engine under `kvscope demo`, a vLLM server)."""

from __future__ import annotations

import os
import signal


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A session (and process group) of its own, so one signal reaches all its processes and a Ctrl-C at the
    terminal reaches only kvscope, which stops it in order; on Linux it also gets SIGTERM if kvscope dies
    without cleaning up."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass
