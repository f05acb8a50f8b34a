"""A tiny deterministic fake scheduler that emits protocol v1 events (test helper).

It keeps a real block table (alloc on growth, free on finish/preemption), so the
block-map deltas in its step events are consistent with its snapshots.
"""

from __future__ import annotations

import random

from kvscope.protocol import events as E
from kvscope.protocol.deltas import BlockDeltaLog


class Synth:
    def __init__(self, seed: int = 0, n_blocks: int = 16, block_size: int = 4, arrival_p: float = 0.6):
        self.rng = random.Random(seed)
        self.n_blocks = n_blocks
        self.bs = block_size
        self.arrival_p = arrival_p
        self.free = list(range(n_blocks))
        self.reqs: dict[int, dict] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.preempted: list[int] = []
        self.next_req = 0
        self.step_no = 0
        self.log = BlockDeltaLog()
        self.t = 0.0

    def hello(self) -> E.HelloEvent:
        return E.HelloEvent(E.PROTOCOL_VERSION, {"model": "synth", "block_size": self.bs,
                                                 "num_blocks": self.n_blocks}, 1_700_000_000.0)

    # ------------------------------------------------------------------ state views
    def owners(self) -> dict[int, int]:
        return {b: r for r, q in self.reqs.items() for b in q["blocks"]}

    def kv(self) -> E.KvCounters:
        used = self.n_blocks - len(self.free)
        return E.KvCounters(total=self.n_blocks, used=used, free=len(self.free))

    def snapshot(self) -> E.SnapshotEvent:
        rs = [
            E.RequestState(r, q["state"], q["prompt"], q["max"], q["computed"], q["out"], q["prio"],
                           q["arrival"], q["ttft"], q["pre"])
            for r, q in sorted(self.reqs.items())
        ]
        blocks = [E.BlockOwner(b, r, 1) for b, r in sorted(self.owners().items())]
        tables = {r: list(q["blocks"]) for r, q in self.reqs.items() if q["blocks"]}
        return E.SnapshotEvent(self.step_no, self.t, rs, blocks, tables, list(self.running),
                               list(self.waiting), list(self.preempted), [], self.kv())

    # ------------------------------------------------------------------ one iteration
    def _alloc(self, r: int, n: int, out: list) -> bool:
        if len(self.free) < n:
            return False
        for _ in range(n):
            b = self.free.pop()
            self.reqs[r]["blocks"].append(b)
            self.log.alloc(b, r)
        return True

    def _release(self, r: int, freed: list) -> None:
        q = self.reqs[r]
        for b in q["blocks"]:
            self.log.free(b)
        self.free.extend(q["blocks"])
        q["blocks"] = []

    def step(self) -> list:
        """Events for one iteration: arrivals (request events), then the step event."""
        rng = self.rng
        out: list = []
        self.step_no += 1
        t0 = self.t
        dur = round(rng.uniform(0.001, 0.02), 6)
        if rng.random() < self.arrival_p:
            r = self.next_req
            self.next_req += 1
            q = dict(state=E.WAITING, prompt=rng.randint(1, 12), max=rng.randint(1, 16), computed=0, out=0,
                     prio=rng.randint(-2, 2), arrival=t0, ttft=None, pre=0, blocks=[])
            self.reqs[r] = q
            self.waiting.append(r)
            out.append(E.RequestEvent(r, q["prompt"], q["max"], q["prio"], t0))
        alloc: list = []
        freed: list = []
        batch: list = []
        preemptions: list = []
        first_tokens: list = []
        finished: list = []
        itl: list = []
        sampled: list = []
        # admit: preempted first, then waiting
        admission = E.Admission(E.VERDICT_IDLE)
        admitted = None
        queue = self.preempted if self.preempted else self.waiting
        if queue:
            r = queue[0]
            q = self.reqs[r]
            need = -(-(q["prompt"] + q["out"]) // self.bs)
            if self._alloc(r, need, alloc):
                queue.pop(0)
                q["state"] = E.RUNNING
                self.running.append(r)
                admission = E.Admission(E.VERDICT_ADMITTED, None, r)
                admitted = r
                n = q["prompt"] + q["out"]
                batch.append(E.BatchEntry(r, E.PREFILL, n, 0))
                q["computed"] = n
            else:
                admission = E.Admission(E.VERDICT_BLOCKED, E.BLOCKED_KV, r)
        # decode everyone already running (not the one just prefilled)
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted earlier in this step
            q = self.reqs[r]
            if r == admitted:
                pass
            else:
                if q["computed"] % self.bs == 0 and q["computed"] > 0:
                    if not self._alloc(r, 1, alloc):
                        # preempt the newest running request (maybe r itself)
                        victim = self.running[-1]
                        self._release(victim, freed)
                        self.running.remove(victim)
                        v = self.reqs[victim]
                        v["state"] = E.PREEMPTED
                        v["computed"] = 0
                        v["pre"] += 1
                        self.preempted.append(victim)
                        preemptions.append(E.Preemption(victim, E.BLOCKED_KV))
                        if victim == r:
                            continue
                        if not self._alloc(r, 1, alloc):
                            continue
                batch.append(E.BatchEntry(r, E.DECODE, 1, q["computed"]))
                q["computed"] += 1
            # one output token
            q["out"] += 1
            sampled.append(r)
            tnow = t0 + dur
            if q["ttft"] is None:
                q["ttft"] = round(tnow - q["arrival"], 6)
                first_tokens.append(E.FirstToken(r, q["ttft"]))
            else:
                itl.append(E.ItlSample(r, dur))
            if q["out"] >= q["max"]:
                self._release(r, freed)
                self.running.remove(r)
                q["state"] = E.FINISHED
                finished.append(E.Finish(r, q["ttft"], round(tnow - q["arrival"], 6), q["out"], "length"))
                del self.reqs[r]
        self.t = round(t0 + dur, 6)
        alloc, freed = self.log.take()
        out.append(
            E.StepEvent(
                self.step_no, t0, dur, 64, batch=batch, running=list(self.running), waiting=list(self.waiting),
                preempted=list(self.preempted), admission=admission, preemptions=preemptions, alloc=alloc,
                freed=freed, sampled=sampled, first_tokens=first_tokens, finished=finished, itl=itl,
                kv=self.kv(),
            )
        )
        return out


def make_events(n_steps: int = 40, seed: int = 0, snapshot_every: int | None = None, **kw):
    """(hello, events, truth) where events opens with a snapshot at step 0 and truth
    maps every step to the true block owners after it."""
    s = Synth(seed, **kw)
    events: list = [s.snapshot()]
    truth = {0: s.owners()}
    for _ in range(n_steps):
        events.extend(s.step())
        truth[s.step_no] = s.owners()
        if snapshot_every and s.step_no % snapshot_every == 0:
            events.append(s.snapshot())
    events.append(E.ByeEvent(s.step_no, s.t))
    return s.hello(), events, truth


def record_synth(path, n_steps: int = 40, seed: int = 0, chunk_steps: int = 8, close: bool = True, **writer_kw):
    """Run the synth engine into a TraceWriter the way the engine does (initial
    snapshot, snapshot_provider for chunk starts). Returns (writer, hello, events as
    written in order, truth step -> owners)."""
    from kvscope.traces.writer import TraceWriter

    s = Synth(seed)
    written: list = []

    def provider():
        snap = s.snapshot()
        written.append(snap)
        return snap

    writer_kw.setdefault("max_chunk_s", None)
    w = TraceWriter(path, s.hello(), chunk_steps=chunk_steps, snapshot_provider=provider, **writer_kw)
    snap0 = s.snapshot()
    written.append(snap0)
    w.publish(snap0)
    truth = {0: s.owners()}
    for _ in range(n_steps):
        for ev in s.step():
            written.append(ev)
            w.publish(ev)
        truth[s.step_no] = s.owners()
    bye = E.ByeEvent(s.step_no, s.t)
    written.append(bye)
    w.publish(bye)
    if close:
        w.close()
    return w, s.hello(), written, truth
