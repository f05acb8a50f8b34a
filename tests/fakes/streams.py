"""Event streams from the real scheduler on the sim backend, for tests (no torch forward, virtual clock).

``SimRun`` drives an engine step by step with seeded random arrivals; every event it
publishes passes through the wire codec, as a subscriber would see it, and after
every step it records the engine's own block map (the truth a rebuilt map must equal).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.errors import KvscopeError
from kvscope.protocol import HelloEvent, SnapshotEvent, decode, encode


def sim_config(**kw) -> EngineConfig:
    base = dict(backend="sim", model="qwen3-0.6b", gpu="l4", num_blocks=48, block_size=16, max_num_seqs=12,
                max_num_batched_tokens=128, max_model_len=512)
    base.update(kw)
    return EngineConfig(**base)


@dataclass
class _Sink:
    events: list = field(default_factory=list)

    def publish(self, event) -> None:
        self.events.append(decode(encode(event)))

    def close(self) -> None:
        pass


class SimRun:
    """A sim engine fed seeded random arrivals: ``step()`` runs one iteration and returns its events.

    Arrivals: with ``arrival_p`` per step 1-3 requests; ``long_p`` of them long prompts;
    ``prefix_share`` of them start with one of two shared prefixes (prefix caching, when
    on, shares their blocks); ``reject_p`` of them too long to serve (a reject event);
    ``burst_size`` more at each step in ``bursts``. Priorities are 0-2.
    """

    def __init__(self, seed: int = 0, *, arrival_p: float = 0.5, snapshot_every: int = 50,
                 prompt_len: tuple[int, int] = (8, 160), max_tokens: tuple[int, int] = (4, 48),
                 long_p: float = 0.05, prefix_share: float = 0.3, reject_p: float = 0.02,
                 bursts: tuple[int, ...] = (), burst_size: int = 6, **config) -> None:
        self.rng = random.Random(seed)
        self.arrival_p = arrival_p
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.long_p = long_p
        self.prefix_share = prefix_share
        self.reject_p = reject_p
        self.bursts = set(bursts)
        self.burst_size = burst_size
        self.prefixes = [[self.rng.randrange(3, 1000) for _ in range(48)] for _ in range(2)]
        self.sink = _Sink()
        self.engine = LLMEngine(sim_config(seed=seed, **config), snapshot_every=snapshot_every or 10**9,
                                snapshot_interval_s=1e12)
        self.engine.wall_start = 1_700_000_000.0 + seed  # the run's identity: the same for the same seed
        self.engine.attach(self.sink)
        self.truth: dict[int, dict[int, int]] = {}  # step -> {block: owner} after that step
        self._taken = 0

    @property
    def done_step(self) -> int:
        return self.engine.scheduler.step_count

    @property
    def t(self) -> float:
        return self.engine.now()

    def hello(self) -> HelloEvent:
        return decode(encode(self.engine.hello()))

    def snapshot(self) -> SnapshotEvent:
        return decode(encode(self.engine.snapshot()))

    def take(self) -> list:
        """Events published since the last take."""
        out = self.sink.events[self._taken:]
        self._taken = len(self.sink.events)
        return out

    def owners(self) -> dict[int, int]:
        """The engine's block map: block -> the owner a watcher shows (the claimer)."""
        bm = self.engine.block_manager
        view = self.engine.block_deltas.view.owner
        return {b: (view[b] if view[b] >= 0 else req) for req, table in bm.tables.items() for b in table}

    def add(self, n: int = 1) -> None:
        rng = self.rng
        limit = self.engine.max_model_len
        for _ in range(n):
            if rng.random() < self.reject_p:
                length = limit + rng.randint(1, 64)
            elif rng.random() < self.long_p:
                length = rng.randint(limit // 3, limit // 2)
            else:
                length = rng.randint(*self.prompt_len)
            prompt = [rng.randrange(3, 1000) for _ in range(length)]
            if rng.random() < self.prefix_share:
                prompt = rng.choice(self.prefixes) + prompt
            params = SamplingParams(max_tokens=rng.randint(*self.max_tokens), ignore_eos=True)
            try:
                self.engine.add_request(prompt, params, priority=rng.choice((0, 0, 0, 1, 2)))
            except KvscopeError:
                pass  # refused: the engine published a reject event

    def step(self) -> list:
        if self.rng.random() < self.arrival_p:
            self.add(self.rng.randint(1, 3))
        if self.done_step + 1 in self.bursts:
            self.add(self.burst_size)
        self.engine.step()
        self.truth[self.done_step] = self.owners()
        return self.take()

    def run(self, steps: int) -> list:
        out = self.take()
        for _ in range(steps):
            out += self.step()
        return out

    def close(self) -> list:
        self.engine.close()
        return self.take()


def sim_stream(steps: int = 200, seed: int = 0, *, bye: bool = True, **kw) -> list:
    """hello, the opening snapshot (step 0), ``steps`` iterations, then bye (if ``bye``)."""
    run = SimRun(seed, **kw)
    return run.run(steps) + (run.close() if bye else [])


def sim_events(steps: int = 200, seed: int = 0, **kw) -> tuple[HelloEvent, list, dict[int, dict[int, int]]]:
    """(hello, the events after it, truth) of a sim run: a snapshot first, bye last."""
    run = SimRun(seed, **kw)
    events = run.run(steps) + run.close()
    return events[0], events[1:], run.truth


def make_events(n_steps: int = 40, seed: int = 0, snapshot_every: int | None = None, **kw):
    """(hello, events, truth): events open with the snapshot at step 0 and end with bye,
    hellos repeated after periodic snapshots left out; truth maps every step to the
    engine's block owners after it."""
    run = SimRun(seed, snapshot_every=snapshot_every or 0, **kw)
    evs = run.run(n_steps) + run.close()
    return evs[0], [e for e in evs[1:] if e.type != "hello"], {0: {}, **run.truth}


def record_run(path, n_steps: int = 40, seed: int = 0, chunk_steps: int = 8, close: bool = True, **writer_kw):
    """Run a sim engine into a TraceWriter the way serve does (opening snapshot, the
    engine's snapshot as the provider for chunk starts). Returns (writer, hello, events
    as written in order, truth step -> owners)."""
    from kvscope.traces.writer import TraceWriter

    run = SimRun(seed, snapshot_every=0)
    hello = run.take()[0]
    written: list = []

    def provider():
        snap = run.snapshot()
        written.append(snap)
        return snap

    writer_kw.setdefault("max_chunk_s", None)
    w = TraceWriter(path, hello, chunk_steps=chunk_steps, snapshot_provider=provider, **writer_kw)
    snap0 = run.snapshot()
    written.append(snap0)
    w.publish(snap0)
    for _ in range(n_steps):
        for ev in run.step():
            written.append(ev)
            w.publish(ev)
    for ev in run.close():
        written.append(ev)
        w.publish(ev)
    if close:
        w.close()
    return w, hello, written, {0: {}, **run.truth}


def drained_sim_stream(seed: int, *, requests: int = 24, mode: str = "chunked", max_num_seqs: int = 8) -> list:
    """The events of a short sim run (Qwen3-0.6B on an H200 shape): hello, snapshot, steps, ..., bye."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", mode=mode, seed=seed,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=256, num_blocks=256))
    sink = _Sink()
    engine.attach(sink)
    rng = random.Random(seed)
    for _ in range(requests):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randrange(16, 200))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(8, 40), ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    return sink.events


class ChunkedSource:
    """A source with the live source's interface: each ``poll`` returns the next ``per_poll`` events."""

    connection = "live"

    def __init__(self, events: list, per_poll: int = 50) -> None:
        self.events = list(events)
        self.per_poll = per_poll
        self.pos = 0
        self.requests: list[str] = []
        self.replies: list = []

    def poll(self) -> list:
        out = self.events[self.pos:self.pos + self.per_poll]
        self.pos += len(out)
        return out

    def request(self, cmd: str, quiet: bool = False, **args) -> None:
        self.requests.append(cmd)
        if cmd in ("pause", "resume"):  # the engine answers with its state, as kvscope's control does
            self.replies.append((cmd, {"ok": True, "paused": cmd == "pause"}, quiet))

    # the rest of LiveSource's face: what a LiveFeed reads beside the events
    error: str | None = None
    dropped_locally = 0  # set by a test: frames "lost" before the next poll
    malformed = 0

    def take_local_dropped(self) -> int:
        n, self.dropped_locally = self.dropped_locally, 0
        return n

    def take_malformed(self) -> tuple[int, str | None]:
        n, self.malformed = self.malformed, 0
        return n, "bad frame" if n else None

    def take_replies(self) -> list:
        out, self.replies = self.replies, []
        return out

    def request_snapshot(self) -> bool:
        self.requests.append("snapshot")
        return True

    def close(self) -> None:
        pass
