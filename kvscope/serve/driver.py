"""Drives an engine over a timed workload, and answers control requests between steps.

Control work per step is bounded: the control server hands over at most a poll's worth of
requests, snapshot requests in one poll share one snapshot, and injected requests stop at
``max_waiting`` queued requests (past it a burst is answered ``refused``).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Iterable, Iterator

from kvscope import workload as wl
from kvscope.errors import KvscopeError
from kvscope.engine.errors import RequestRejected
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.metrics import MetricsCollector, Summary
from kvscope.engine.request import Request
from kvscope.engine.sampling_params import SamplingParams
from kvscope.serve.arrival_clock import ArrivalClock
from kvscope.serve.options import ServeOptions
from kvscope.workload.text_prompts import TextPrompts

IDLE_POLL_S = 0.02  # how often an idle or paused engine looks at the control socket
LONG_PROMPT_TOKENS = 2048
REFUSED_NOTICE_EVERY_S = 10.0  # a saturated engine says it is refusing requests, but not once per request


def reserved_top_ids(vocab: int, eos_token_ids: frozenset[int]) -> int:
    """How many ids at the top of the vocab to keep out of generated prompts: special tokens sit there."""
    top = max(eos_token_ids) if eos_token_ids else -1
    return vocab - top if top >= vocab // 2 else 0


class Server:
    def __init__(self, engine: LLMEngine, options: ServeOptions, control=None,
                 on_progress: Callable[[int], None] | None = None, inbox=None,
                 on_finished: Callable[[Request], None] | None = None) -> None:
        self.engine = engine
        self.options = options
        self.control = control
        self.inbox = inbox  # kvscope.serve.bridge.EngineBridge: HTTP requests (poll / wait / after_step)
        self.on_progress = on_progress
        self.on_finished = on_finished  # each finished request, after the metrics took it (bench's goodput)
        self.metrics = MetricsCollector()
        self.paused = False
        self.stopping = False  # the control socket's stop
        self.stop = threading.Event()  # Ctrl-C or SIGTERM (kvscope.cli.stop_signals), checked every step
        self.spec = wl.load_spec(options.workload)
        self.vocab = engine.loaded.vocab_size
        self.reserved = reserved_top_ids(self.vocab, engine.loaded.eos_token_ids)
        self._injected: list[wl.WorkloadRequest] = []
        self.refused = 0  # requests not queued because max_waiting were already waiting
        self._refused_notice = -REFUSED_NOTICE_EVERY_S
        self._seed_counter = options.seed * 7919 + 1
        # a model that reads text is served real instructions in place of random token ids
        tokenizer = engine.tokenizer
        self.texts = (TextPrompts(tokenizer, options.seed) if getattr(tokenizer, "has_chat_template", False)
                      else None)
        self._submitted = 0
        self.arrivals: ArrivalClock | None = None  # the workload's clock, while run() runs

    def requests(self) -> Iterator[wl.WorkloadRequest]:
        max_prompt = self.engine.max_model_len - 1
        if self.options.forever:
            return wl.generate_forever(self.spec, vocab_size=self.vocab, seed=self.options.seed,
                                       reserved_ids=self.reserved, max_prompt_len=max_prompt,
                                       burst_every_s=self.options.burst_every_s)
        return wl.generate_iter(self.spec, vocab_size=self.vocab, num_requests=self.options.num_requests,
                                seed=self.options.seed, max_prompt_len=max_prompt, reserved_ids=self.reserved)

    # ---- control ------------------------------------------------------------------
    def _next_seed(self) -> int:
        self._seed_counter += 1
        return self._seed_counter

    def queued(self) -> int:
        """Requests waiting for admission: the engine's queue and the injected ones not yet submitted."""
        return len(self.engine.scheduler.waiting) + len(self._injected)

    def _room(self) -> int:
        cap = self.options.max_waiting
        return (1 << 62) if cap is None else max(0, cap - self.queued())

    def _inject(self, req, items: list[wl.WorkloadRequest], asked: int) -> None:
        self._injected += items
        if len(items) < asked:
            self.refused += asked - len(items)
            req.reply(ok=False, error=f"refused: {self.queued()} requests are waiting (max_waiting "
                                      f"{self.options.max_waiting}); added {len(items)} of {asked}",
                      refused=asked - len(items), added=len(items))
        else:
            req.reply(ok=True, added=len(items))

    def _handle_control(self, now: float) -> None:
        snapshot_replies = []
        for req in self.control.poll():
            args = req.args
            if req.cmd == "snapshot":
                snapshot_replies.append(req)  # one snapshot answers every request of this poll
            elif req.cmd in ("burst", "add"):
                n = args.get("n", 16)
                try:
                    spec = wl.load_spec(args.get("workload", "burst")) if req.cmd == "add" else self.spec
                except KvscopeError as e:
                    req.reply(ok=False, error=str(e))
                    continue
                k = min(n, self._room())
                items = wl.make_burst(spec, k, at=now, vocab_size=self.vocab, seed=self._next_seed(),
                                      reserved_ids=self.reserved,
                                      max_prompt_len=self.engine.max_model_len - 1) if k else []
                self._inject(req, items, n)
            elif req.cmd == "long":
                if not self._room():
                    self._inject(req, [], 1)  # answered: refused
                    continue
                length = min(args.get("prompt_len", LONG_PROMPT_TOKENS), self.engine.max_model_len - 1)
                self._injected.append(wl.make_long_prompt(length, at=now, vocab_size=self.vocab,
                                                          seed=self._next_seed(), reserved_ids=self.reserved))
                req.reply(ok=True, prompt_len=length)
            elif req.cmd in ("pause", "resume"):
                self.paused = req.cmd == "pause"
                if self.arrivals is not None:  # the whole world pauses: arrivals too
                    self.arrivals.set_paused(self.paused, self.engine.now())
                req.reply(ok=True, paused=self.paused)
            elif req.cmd == "stop":
                self.stopping = True
                req.reply(ok=True)
        if snapshot_replies:
            self.engine.publish_snapshot()
            for req in snapshot_replies:
                req.reply(ok=True, step=self.engine.scheduler.step_count)

    # ---- the loop -----------------------------------------------------------------------
    def _submit(self, item: wl.WorkloadRequest, arrival: float, *, counted: bool = False,
                as_given: bool = False) -> None:
        """Queue one request; ``counted``: its room under max_waiting was taken when it was injected;
        ``as_given``: served with its own token ids and lengths even on a model that reads text."""
        cap = self.options.max_waiting
        if not counted and cap is not None and len(self.engine.scheduler.waiting) >= cap:
            self.metrics.rejected += 1
            self.refused += 1
            now = time.monotonic()
            if self.options.verbose_rejects and now - self._refused_notice >= REFUSED_NOTICE_EVERY_S:
                self._refused_notice = now
                print(f"kvscope: {cap} requests are waiting (max_waiting): refusing new ones "
                      f"({self.refused} so far)", file=sys.stderr)
            return
        prompt, ignore_eos = item.prompt, item.ignore_eos
        if self.texts is not None and not as_given:  # a real reply ends at its end-of-turn token
            prompt = self.texts.prompt(len(item.prompt), self._submitted, self.engine.max_model_len - 1)
            ignore_eos = False
        self._submitted += 1
        # random token ids: nobody reads their text; real prompts' replies are read in request detail
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=ignore_eos, detokenize=self.texts is not None)
        try:
            self.engine.add_request(prompt, params, item.priority, arrival=arrival)
        except RequestRejected as e:
            self.metrics.rejected += 1
            if self.options.verbose_rejects:
                print(f"kvscope: rejected request: {e}", file=sys.stderr)

    def run(self, items: Iterable[wl.WorkloadRequest] | None = None) -> Summary:
        """Serve `items` as given (a bench's fixed work: every row, kvscope's and the peers', serves the
        same token ids to the same lengths), or else the workload's own requests."""
        as_given = items is not None
        source = iter(items) if items is not None else self.requests()
        upcoming = next(source, None)
        start = self.engine.now()
        clock = self.engine.clock
        arrivals = self.arrivals = ArrivalClock(start, self.options.step_clock_s if self.options.forever else None)
        while not (self.stopping or self.stop.is_set()):
            now = self.engine.now()
            arrivals.tick(now)
            if self.control is not None:
                self._handle_control(now - start)
            if self.inbox is not None:
                self.inbox.poll()
            injected, self._injected = self._injected, []
            for item in injected:
                self._submit(item, start + item.arrival, counted=True)
            while upcoming is not None and arrivals.due(upcoming.arrival, now):
                self._submit(upcoming, arrivals.engine_time(upcoming.arrival, now), as_given=as_given)
                upcoming = next(source, None)
            if not self.paused and self.engine.has_unfinished():
                finished = self.engine.step()
                arrivals.stepped()
                for req in finished:
                    self._finished(req)
                if self.inbox is not None:
                    self.inbox.after_step(finished)
            elif upcoming is None and not self.options.forever and not self.engine.has_unfinished():
                break
            else:
                # paused: nothing is due until the resume, so poll the control socket at its pace (no busy loop)
                wait = IDLE_POLL_S if upcoming is None or self.paused else arrivals.wait_s(upcoming.arrival, now)
                if clock.jumps and upcoming is not None and not self.paused:
                    clock.sleep_until(arrivals.due_time(upcoming.arrival, now))  # virtual time: jump the idle gap
                else:
                    pause = max(0.0, min(wait, IDLE_POLL_S))
                    if self.inbox is not None and not clock.jumps:
                        self.inbox.wait(pause)  # wakes at once when an HTTP request arrives
                        continue
                    clock.sleep_until(self.engine.now() + pause)
                    if clock.jumps and self.inbox is not None:
                        self.inbox.wait(pause)  # virtual time: wait for the human or an HTTP client
                    elif clock.jumps:
                        time.sleep(pause)  # paused on virtual time: wait for the human, not the clock
        self.arrivals = None
        return self.summary()

    def _finished(self, req: Request) -> None:
        self.metrics.add(req)
        if self.on_finished is not None:
            self.on_finished(req)
        if self.on_progress is not None:
            self.on_progress(1)

    def summary(self) -> Summary:
        return self.metrics.summary(preemptions=self.engine.num_preemptions, kv_waste=self.engine.mean_kv_waste,
                                    steps=self.engine.scheduler.step_count)
