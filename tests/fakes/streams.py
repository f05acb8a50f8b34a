"""Event streams made by the real scheduler (sim backend), and a source that hands them out in chunks."""

from __future__ import annotations

import random


class ListSink:
    """An event sink that keeps every event (for building fixture streams)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def sim_stream(seed: int, *, requests: int = 24, mode: str = "chunked", max_num_seqs: int = 8) -> list:
    """The events of a short sim run (Qwen3-0.6B on an H200 shape): hello, snapshot, steps, ..., bye."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(backend="sim", model="qwen3-0.6b", gpu="h200", mode=mode, seed=seed,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=256, num_blocks=256))
    sink = ListSink()
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

    def poll(self) -> list:
        out = self.events[self.pos:self.pos + self.per_poll]
        self.pos += len(out)
        return out

    def request(self, cmd: str, quiet: bool = False, **args) -> None:
        self.requests.append(cmd)

    def close(self) -> None:
        pass
