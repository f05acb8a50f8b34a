"""A stand-in llama-server for the `--peers llama-server` tests, run as a process the way the real binary is.

It takes the flags kvscope passes, answers /health (503 "Loading model" first, as the real one does while it
loads) and streams /completion as server-sent events: `data: {...}` lines with `tokens_predicted`, the count
so far, the last one with `"stop": true`. Every third token gets no event of its own and is counted by the
next, as the real server does for a token that ends inside a UTF-8 character. It appends its argv and every request body to FAKE_LLAMA_LOG (JSON
lines). With FAKE_LLAMA_FAIL set it prints that text and exits 1, as a server that cannot load does; with
FAKE_LLAMA_CRASH set it dies in the middle of the first request after the warm-up, as a crashed one does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _log(record: dict) -> None:
    path = os.environ.get("FAKE_LLAMA_LOG")
    if path:
        with _LOCK, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


_LOCK = threading.Lock()
_HEALTH_CALLS = [0]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _HEALTH_CALLS[0] += 1
        loading = _HEALTH_CALLS[0] == 1
        body = b'{"error":{"code":503,"message":"Loading model"}}' if loading else b'{"status":"ok"}'
        self.send_response(503 if loading else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _log({"path": self.path, "body": request})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n, first = request["n_predict"], request["prompt"][-1]
        for sent in range(1, n + 1):
            if os.environ.get("FAKE_LLAMA_CRASH") and request["prompt"] != [1, 2, 3] and sent == 2:
                os._exit(1)
            if sent % 3 != 1 or sent == n:  # the 1st, 4th, 7th, ... token is held back and counted by the next event
                self._event({"content": "x", "tokens": [first + sent], "tokens_predicted": sent, "stop": False})
        self._event({"content": "", "tokens": [], "tokens_predicted": n, "stop": True, "timings": {"predicted_n": n}})
        self.close_connection = True

    def _event(self, event: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    for flag in ("-t", "-tb", "-np", "-c", "-cram"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--no-webui", action="store_true")
    args = p.parse_args()
    if os.environ.get("FAKE_LLAMA_FAIL"):
        print("main: loading model", flush=True)
        print(os.environ["FAKE_LLAMA_FAIL"], flush=True)
        return 1
    _log({"argv": sys.argv[1:]})
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
