"""Ctrl-C and SIGTERM for the commands that run until stopped (serve, record): a flag as well as an exception.

A KeyboardInterrupt raised while Python runs a `__del__` or a weakref callback is swallowed, and printed
with a traceback ("Exception ignored in ..."): a Ctrl-C that landed during a garbage collection was lost, and
`serve --forever` served on. The handler also sets an Event that the command's loop checks each step, so the
stop happens either way, and such a swallowed interrupt is not printed: it was a stop, not an error.
"""

from __future__ import annotations

import signal
import sys
import threading


class StopSignals:
    """While active, SIGINT and SIGTERM set `stop` and raise KeyboardInterrupt (while `checked`, the first
    one only sets `stop`).

    A SIGINT that was ignored when the process started (a background job of a non-interactive shell) stays
    ignored, as the shell's convention asks; SIGTERM always stops.
    """

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()
        # set while the command's loop checks `stop` at every turn: a first signal then only sets the
        # flag, so no KeyboardInterrupt lands inside a half-done write (a trace chunk handed to its
        # writer thread); a second one still raises, for a loop stuck in one long step
        self.checked = False
        self._saved: dict = {}
        self._unraisable_hook = None

    @property
    def requested(self) -> bool:
        return self.stop.is_set()

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.getsignal(sig)
            if not (sig == signal.SIGINT and self._saved[sig] == signal.SIG_IGN):
                signal.signal(sig, self._handle)
        self._unraisable_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def _unraisable(self, unraisable) -> None:
        if not (self.stop.is_set() and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._unraisable_hook(unraisable)

    def _handle(self, signum, frame) -> None:
        first = not self.stop.is_set()
        self.stop.set()
        if self.checked and first:
            return
        raise KeyboardInterrupt

    def ignore(self) -> None:
        """While the command closes its trace and sockets: a second Ctrl-C must not cut that short."""
        for sig in self._saved:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if self._unraisable_hook is not None:
            sys.unraisablehook = self._unraisable_hook
