"""The control socket of a watched vLLM (KVSCOPE_VLLM_CONTROL): a watcher that joins late asks for a snapshot.

kvscope's dashboard and recorder ask the engine for a `snapshot` when they join, when a chunk of the
trace is full, and after a gap; a kvscope engine answers at once. Inside vLLM only the scheduler's
own thread may read its state, so here the request marks the next step for a snapshot (and a hello)
and is answered `ok` at once; the snapshot follows with vLLM's next step. Every other command is
answered with one line saying a watched vLLM takes its traffic over HTTP (docs/PROTOCOL.md's control
channel: every request gets exactly one reply). The socket is polled on a thread of its own, twenty
times a second; nothing it does can reach vLLM's scheduler but the one flag.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvscope.vllm_watch")
POLL_S = 0.05
NOT_HERE = "a watched vLLM answers only snapshot: send it traffic over its HTTP API, and stop it as vLLM is stopped"


class WatchControl:
    def __init__(self, addr: str, on_snapshot, *, allow_remote: bool = False) -> None:
        from kvscope.protocol.control import ControlServer

        self._server = ControlServer(addr, allow_remote)
        self.addr = self._server.addr
        self._on_snapshot = on_snapshot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                for req in self._server.poll():
                    if req.cmd == "snapshot":
                        self._on_snapshot()
                        req.reply(ok=True, note="the snapshot follows with vLLM's next step")
                    else:
                        req.reply(ok=False, error=NOT_HERE)
        except Exception as e:  # noqa: BLE001 - the control socket must never reach vLLM
            log.warning("kvscope: the control socket stopped: %s: %s", type(e).__name__, e)
        finally:
            self._server.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
