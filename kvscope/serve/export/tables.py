"""Per-request and per-step CSV tables (one row per request / step), for pandas users."""

from __future__ import annotations

import csv

from kvscope.protocol.events import StepEvent
from kvscope.serve.export.lifecycle import Life
from kvscope.serve.metrics import step_kind

REQUEST_COLUMNS = ["req", "source", "arrival", "prompt_tokens", "max_tokens", "priority", "cached_tokens",
                   "first_scheduled", "queue_time", "ttft", "e2e", "output_tokens", "prefill_chunks", "preemptions",
                   "finish_reason", "finish_t"]
STEP_COLUMNS = ["step", "t", "dur", "kind", "tokens", "batch_size", "prefill_tokens", "decode_tokens", "padding",
                "budget", "running", "waiting", "preempted", "swapped", "kv_total", "kv_used", "kv_cached", "kv_free",
                "kv_shared", "admission", "blocked_by", "preemptions", "finished", "swaps", "dropped"]


def _num(x):
    return "" if x is None else x


class RequestsCsv:
    def __init__(self, path: str) -> None:
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(REQUEST_COLUMNS)

    def request(self, life: Life) -> None:
        queue = None if life.first_scheduled is None else life.first_scheduled - life.arrival
        self.w.writerow([life.req, life.source, life.arrival, life.prompt_len, life.max_tokens, life.priority,
                         life.cached_tokens, _num(life.first_scheduled), _num(queue), _num(life.ttft),
                         _num(life.e2e), life.output_len, life.prefill_chunks, life.preemptions, life.finish_reason,
                         _num(life.finish_t)])

    def close(self) -> None:
        self.f.close()


class StepsCsv:
    def __init__(self, path: str) -> None:
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(STEP_COLUMNS)

    def step(self, ev: StepEvent) -> None:
        prefill = sum(b.tokens for b in ev.batch if b.kind == "prefill")
        decode = sum(b.tokens for b in ev.batch if b.kind == "decode")
        kv = ev.kv
        self.w.writerow([ev.step, ev.t, ev.dur, step_kind(ev), prefill + decode, len(ev.batch), prefill, decode,
                         ev.padding, ev.budget, len(ev.running), len(ev.waiting), len(ev.preempted), len(ev.swapped),
                         kv.total, kv.used, kv.cached, kv.free, kv.shared, ev.admission.verdict,
                         ev.admission.reason or "", len(ev.preemptions), len(ev.finished), len(ev.swaps), ev.dropped])

    def close(self) -> None:
        self.f.close()
