"""What watching costs vLLM: the watched scheduler's per-step time beside vLLM's own scheduler time, one run.

    python benchmarks/vllm_watch_cost.py [--running 64 256] [--blocks 16384 65536] [--steps 200]

For each load and pool size, two schedulers built by vLLM's path (tests/fakes/vllm_core.py) take the
same requests: vLLM's own ``Scheduler`` and ``WatchedScheduler`` publishing to an in-memory publisher.
They step alternately, A B then B A (the same load on both, neither always first), ``--running``
requests in decode with a 512-token prompt admitted (and one request aborted) every 8 steps. Per step
it times each one's ``schedule()`` + ``update_from_output()`` (the watched one's with the watch's hooks
inside), the hooks alone (the time vLLM's thread spends in kvscope: the captures), and apart, off the
clock of both, what the watch's own thread does with them (assembling the events) and what
ZmqPublisher's thread does (encoding). Prints a table: medians over the steps, and the hooks' share of
vLLM's step by median and by mean (the mean carries the snapshot every 256 steps and the machine's noise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(running: int, blocks: int, steps: int) -> dict:
    from kvscope.vllm.inproc.watched import Watch
    from kvscope.protocol.codec import encode
    from tests.fakes.vllm_core import Core, build

    class Timed:
        """An in-memory publisher; the events are encoded later, off the clock (ZmqPublisher's thread)."""

        def __init__(self):
            self.events = []

        def publish(self, ev):
            self.events.append(ev)

        def take_dropped(self):
            return 0

        def close(self, linger=0.0):
            pass

    kw = dict(num_blocks=blocks, max_num_seqs=running, max_num_batched_tokens=8192, max_model_len=8192)
    plain = Core(build(None, **kw))
    sched = build("kvscope.vllm.inproc.watched.WatchedScheduler", **kw)
    pub = Timed()
    watch = sched._kvscope = Watch(sched, pub, background=False)
    watched = Core(sched)
    queued: list = []
    watch._submit = queued.append  # captures wait here: assembled after the timed step, as the watch's thread would
    hook = {"t": 0.0}
    for name in ("added", "scheduled", "updated"):
        orig = getattr(watch, name)

        def timed(*a, _orig=orig):
            t = time.perf_counter()
            _orig(*a)
            hook["t"] += time.perf_counter() - t
        setattr(watch, name, timed)

    def add(core, i):
        core.add([1 + (i * 31 + k) % 997 for k in range(512)], 100_000)

    for i in range(running):
        add(plain, i)
        add(watched, i)
    for _ in range(running * 512 // 8192 + 4):  # prefill everyone
        plain.step()
        watched.step()
    vllm_t, watched_t, watch_t, assemble_t, encode_t = [], [], [], [], []
    extra = running
    for s in range(steps):
        if s % 8 == 0:  # a long prompt arrives now and then: an admission, a prefill chunk, new blocks
            plain.sched.finish_requests(plain.sched.running[0].request_id, _aborted())
            watched.sched.finish_requests(watched.sched.running[0].request_id, _aborted())
            add(plain, extra)
            add(watched, extra)
            extra += 1
        hook["t"] = 0.0
        # A B, then B A: neither scheduler always runs first (caches, the other jobs' load)
        for core in ((plain, watched) if s % 2 == 0 else (watched, plain)):
            t = time.perf_counter()
            core.step()
            (vllm_t if core is plain else watched_t).append(time.perf_counter() - t)
        watch_t.append(hook["t"])
        t = time.perf_counter()
        for item in queued:
            watch._assemble(item)
        queued.clear()
        assemble_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        for ev in pub.events:
            encode(ev)
        encode_t.append(time.perf_counter() - t)
        pub.events.clear()
    assert len(sched.running) == running and watch.errors == 0, (len(sched.running), watch.last_error)
    med = statistics.median
    mean = statistics.fmean
    return dict(running=running, blocks=blocks, steps=steps, vllm_ms=1e3 * med(vllm_t), watched_ms=1e3 * med(watched_t),
                watch_ms=1e3 * med(watch_t), assemble_ms=1e3 * med(assemble_t), encode_ms=1e3 * med(encode_t),
                share=med(watch_t) / med(vllm_t),
                share_mean=mean(watch_t) / mean(vllm_t), step_cost=med(watched_t) / med(vllm_t) - 1)


def _aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print("| running | KV blocks | vLLM schedule+update (ms/step) | watched step (ms/step) | "
          "watch, vLLM's thread (ms/step) | share (median) | share (mean) | watched / plain - 1 | "
          "assemble, watch's thread (ms/step) | encode, publisher's thread (ms/step) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.running:
        for b in args.blocks:
            r = run(n, b, args.steps)
            print(f"| {r['running']} | {r['blocks']:,} | {r['vllm_ms']:.2f} | {r['watched_ms']:.2f} | {r['watch_ms']:.3f} | "
                  f"{100 * r['share']:.1f}% | {100 * r['share_mean']:.1f}% | {100 * r['step_cost']:+.1f}% | "
                  f"{r['assemble_ms']:.2f} | {r['encode_ms']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
