"""A live `kvscope serve --http` in this process: engine loop on a thread, uvicorn on another, port chosen free."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from _helpers import DEADLINE_S

from kvscope.engine import LLMEngine
from kvscope.engine.config import EngineConfig
from kvscope.protocol.sinks import FanOut
from kvscope.serve.driver import ServeOptions, Server
from kvscope.serve.frontend import FrontEnd

STOP_TIMEOUT_S = 15


class Recorder:
    def __init__(self) -> None:
        self.events = []
        self.lock = threading.Lock()

    def publish(self, event) -> None:
        with self.lock:
            self.events.append(event)

    def of_type(self, kind: str) -> list:
        with self.lock:
            return [e for e in self.events if e.type == kind]

    def close(self) -> None:
        pass


@dataclass
class Live:
    engine: LLMEngine
    front: FrontEnd
    driver: Server
    recorder: Recorder
    base_url: str

    def wait_until(self, cond, timeout: float = DEADLINE_S, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.02)

    def idle(self) -> bool:
        """Nothing live in the engine and no block held (read from the engine thread's last step)."""
        steps = self.recorder.of_type("step")
        return (not self.engine.has_unfinished() and self.front.bridge.num_live == 0
                and (not steps or (steps[-1].kv.used == 0 and not steps[-1].running and not steps[-1].waiting)))


@contextlib.contextmanager
def serving(config: EngineConfig | None = None, *, forever_workload: str | None = None, max_waiting=None,
            served_model_name: str | list[str] | None = "tiny", api_key: str | None = None,
            sinks=None, trust_request_chat_template: bool = False):
    """``sinks``: engine -> more event sinks (e.g. a TraceWriter, which needs the engine's hello)."""
    engine = LLMEngine(config or EngineConfig(num_blocks=256, max_num_seqs=64, max_num_batched_tokens=512,
                                              dtype="float32"))
    front = FrontEnd(engine, http="127.0.0.1:0", metrics_port=None, served_model_name=served_model_name,
                     allow_remote=False, max_waiting=max_waiting, api_key=api_key,
                     trust_request_chat_template=trust_request_chat_template)
    recorder = Recorder()
    engine.attach(FanOut([front.sink, recorder, *(sinks(engine) if sinks else ())]))
    options = ServeOptions(workload=forever_workload or "mixed", forever=True, verbose_rejects=False)
    driver = Server(engine, options, inbox=front.bridge)
    errors: list[BaseException] = []

    def loop():
        try:
            driver.run(items=None if forever_workload else ())
        except BaseException as e:  # surfaced by the fixture, not lost in the thread
            errors.append(e)

    front.start()
    thread = threading.Thread(target=loop, name="engine-loop", daemon=True)
    thread.start()
    try:
        yield Live(engine, front, driver, recorder, f"http://127.0.0.1:{front.http.port}")
    finally:
        driver.stopping = True
        thread.join(STOP_TIMEOUT_S)
        front.close()
        assert not thread.is_alive(), "the engine loop did not stop"
        if errors:
            raise errors[0]
