#!/usr/bin/env python3
"""A stand-in for vLLM's OpenAI server, run as the process `kvscope serve --engine vllm` starts.

Named by KVSCOPE_VLLM_PYTHON (an executable file that runs this script), it is called exactly as vLLM's
python is: `-m vllm.entrypoints.openai.api_server --model DIR --port N ...`. It writes its argv and the
variables kvscope sets to FAKE_VLLM_LOG (one JSON line), then:
- FAKE_VLLM_FAIL=TEXT: prints a vLLM-style failure (the cause, then the engine core's "See root cause
  above") and exits 1, as a vLLM that cannot start does;
- otherwise serves /health (503 for the first FAKE_VLLM_LOADING calls), /metrics (vLLM's preemption
  counter), and /v1/completions streamed with `return_token_ids` (token k of a request is prompt[-1] + k;
  every third chunk carries two ids), and publishes a kvscope event stream (a sim engine's hello,
  snapshot and steps) on KVSCOPE_VLLM_PUBLISH as the watched scheduler does;
- FAKE_VLLM_DIE_AFTER=S: dies S seconds after /health first answered 200, with an error line and no bye;
- FAKE_VLLM_IGNORE_TERM=1: ignores SIGTERM (kvscope must then SIGKILL its group).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

_HEALTH = [0]
_READY = threading.Event()  # set when /health first answered 200: a crash is timed from there


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            _HEALTH[0] += 1
            loading = _HEALTH[0] <= int(os.environ.get("FAKE_VLLM_LOADING", "2"))
            self._send(503 if loading else 200, b"")
            if not loading:
                _READY.set()
        elif self.path == "/metrics":
            self._send(200, b'# TYPE vllm:num_preemptions_total counter\n'
                            b'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n')
        else:
            self._send(404, b"")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = body["prompt"][-1]
        ids = [base + k for k in range(body["max_tokens"])]
        i = n = 0
        while i < len(ids):
            take = 2 if n % 3 == 2 else 1
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": ids[i:i + take],
                                  "finish_reason": "length" if i + take >= len(ids) else None}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            i += take
            n += 1
            time.sleep(0.002)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _publish(addr: str, stop: threading.Event) -> None:
    from kvscope.protocol.transport import ZmqPublisher
    from tests.fakes.streams import sim_stream

    pub = ZmqPublisher(addr, heartbeat_s=0.2)
    time.sleep(0.5)  # the recorder's subscription arrives
    for ev in sim_stream(steps=400, seed=3, bye=False):
        if stop.wait(0.01):
            break
        pub.publish(ev)
    stop.wait()


def main() -> None:
    argv = sys.argv[1:]
    keep = ("KVSCOPE_VLLM_PUBLISH", "KVSCOPE_VLLM_CONTROL", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
            "KVSCOPE_VLLM_ALLOW_REMOTE", "VLLM_USE_AOT_COMPILE")
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"argv": argv, "env": {k: os.environ.get(k) for k in keep}}) + "\n")
    print("(APIServer pid=1) INFO 12-07 13:00:49 [api_utils.py:286] non-default args: {}", flush=True)
    fail = os.environ.get("FAKE_VLLM_FAIL")
    if fail:
        print("(EngineCore pid=2) ERROR 12-07 13:00:50 [core.py:1] Traceback (most recent call last):")
        print('(EngineCore pid=2) ERROR 12-07 13:00:50 [core.py:1]   File "core.py", line 1, in <module>')
        print(f"(EngineCore pid=2) ERROR 12-07 13:00:50 [core.py:1] ValueError: {fail}")
        print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
        sys.exit(1)
    server = ThreadingHTTPServer((_flag(argv, "--host"), int(_flag(argv, "--port"))), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_VLLM_IGNORE_TERM")
                  else (lambda *_: stop.set()))
    if os.environ.get("KVSCOPE_VLLM_PUBLISH"):
        threading.Thread(target=_publish, args=(os.environ["KVSCOPE_VLLM_PUBLISH"], stop), daemon=True).start()
    print("INFO:     Application startup complete.", flush=True)
    die_after = os.environ.get("FAKE_VLLM_DIE_AFTER")
    if die_after:
        _READY.wait()
        time.sleep(float(die_after))
        print("(EngineCore pid=2) ERROR 12-07 13:01:00 [core.py:9] RuntimeError: the engine core died", flush=True)
        os._exit(3)
    while not stop.wait(0.1):
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
