"""`space` pauses the whole world: while the engine is paused, the workload's arrivals wait too."""

from __future__ import annotations

from kvscope.engine.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.serve.arrival_clock import ArrivalClock
from kvscope.serve.driver import ServeOptions, Server
from kvscope.workload import WorkloadRequest


class _Req:
    def __init__(self, cmd: str) -> None:
        self.cmd, self.args, self.replies = cmd, {}, []

    def reply(self, **kw) -> None:
        self.replies.append(kw)


class _PauseThenResume:
    """A control socket: pause at the first poll, resume at poll ``resume_at``; notes what the engine held."""

    def __init__(self, engine: LLMEngine, resume_at: int) -> None:
        self.engine, self.resume_at, self.polls = engine, resume_at, 0
        self.seen: list[tuple[int, float, int]] = []  # (poll, engine time, requests the engine was given)
        self.resumed_at: float | None = None

    def poll(self) -> list[_Req]:
        self.polls += 1
        self.seen.append((self.polls, self.engine.now(), self.engine._next_id))
        if self.polls == 1:
            return [_Req("pause")]
        if self.polls == self.resume_at:
            self.resumed_at = self.engine.now()
            return [_Req("resume")]
        return []


def test_pause_stops_arrivals_and_resume_brings_no_backlog():
    # the sim backend: a virtual clock that moves on while paused, so a second of paused time costs no wall time
    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", num_blocks=400))
    items = [WorkloadRequest(arrival=0.25 * i, prompt=[5 + i, 6, 7, 8], max_tokens=4) for i in range(5)]
    control = _PauseThenResume(engine, resume_at=100)
    summary = Server(engine, ServeOptions(verbose_rejects=False), control=control).run(items)
    assert summary.requests == 5
    paused = [(t, given) for poll, t, given in control.seen if poll < control.resume_at]
    assert paused[-1][0] > 1.0 + paused[0][0], "the paused stretch outlasts every arrival time"
    assert all(given == 0 for _, given in paused), "no request arrived while paused"
    # after the resume the traffic picks up where it stopped: one request is due at once, the rest later
    just_after = [given for poll, t, given in control.seen if poll == control.resume_at + 1]
    assert just_after == [1]
    assert engine.now() >= control.resumed_at + 1.0  # the last arrival (t=1.0) came a second after the resume


def test_step_clock_advances_per_step_and_in_real_time_when_idle():
    c = ArrivalClock(start=100.0, step_s=0.01)
    c.stepped()
    c.tick(150.0)  # a 50 s step still counts 10 ms of traffic
    assert c.t == 0.01 and c.due(0.01, 150.0) and not c.due(0.02, 150.0)
    c.tick(152.0)  # idle for 2 s: the traffic's clock runs in real time
    assert abs(c.t - 2.01) < 1e-9
    c.set_paused(True, 152.0)
    c.tick(200.0)
    assert abs(c.t - 2.01) < 1e-9 and not c.due(0.0, 200.0), "paused: the clock stands and nothing is due"
    c.set_paused(False, 200.0)
    assert c.due(2.0, 200.0)


def test_wall_clock_without_pause_keeps_exact_arrival_times():
    c = ArrivalClock(start=0.1)
    assert c.engine_time(0.7, 5.0) == 0.1 + 0.7 and c.due_time(0.7, 0.0) == 0.1 + 0.7
    c.set_paused(True, 1.0)
    c.set_paused(False, 4.0)
    assert c.engine_time(0.7, 5.0) == 0.1 + 3.0 + 0.7 and not c.due(2.0, 5.0) and c.due(1.9, 5.0)


def test_the_demo_engine_runs_its_traffic_on_the_step_clock():
    from kvscope.cli import build_parser
    from kvscope.tui.launch.demo import demo_command

    args = build_parser().parse_args(demo_command("tcp://127.0.0.1:6001", "tcp://127.0.0.1:6002")[3:])
    assert args.forever and args.step_clock == 0.01 and args.max_num_seqs == 16 and args.num_blocks == 256
