"""The crossing between HTTP handlers and the engine thread.

Handlers (on the server's event loop) put jobs and aborts on one thread-safe
queue. The engine thread drains it between steps (`poll`), blocks on it when idle
(`wait`, no busy waiting), and after every step hands each live job its new text
(`after_step`) through the job's own `deliver` callback, which the handler made
thread-safe (``loop.call_soon_threadsafe``). The text comes from the engine's own
incremental detokenizer (kvscope.engine.detokenizer), which also ends a request at
its stop string in the step that produced it.

A job with SamplingParams.n > 1 is n engine sequences (the scheduler forks them from one
prompt, sharing its KV blocks); each update names its choice `index`, and `remaining`
says how many of the job's sequences are still running, so the handler knows when the
whole reply is done. Aborting a job aborts every sequence it still has.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Callable

from kvscope.errors import KvscopeError
from kvscope.engine.errors import RequestRejected
from kvscope.engine.outputs import ending
from kvscope.engine.sampling_params import SamplingParams
from kvscope.protocol.events import FINISH_ABORT, SOURCE_HTTP

REJECTED, ACCEPTED, DELTA, DONE = "rejected", "accepted", "delta", "done"
# why a job was refused before it reached the scheduler (the HTTP layer picks the status code)
TOO_LONG, BAD_PROMPT, QUEUE_FULL, STOPPED = "context_length_exceeded", "bad_prompt", "queue_full", "stopped"
BAD_MIN_TOKENS = "bad_min_tokens"  # min_tokens past the default max_tokens (the rest of the context)


@dataclass(slots=True)
class Update:
    kind: str  # REJECTED, ACCEPTED, DELTA or DONE
    text: str = ""  # new output text (DELTA, DONE)
    finish_reason: str | None = None  # DONE: the engine's reason ("stop", "length", "max_model_len", "abort", "error")
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens generated so far
    error: str = ""  # REJECTED: why; DONE with reason "error": what failed
    code: str = ""  # REJECTED: TOO_LONG, BAD_PROMPT, QUEUE_FULL or STOPPED
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the tokens since the last update
    token_ids: list[int] = field(default_factory=list)  # ACCEPTED: the prompt's; DELTA/DONE: the new output ids
    index: int = 0  # the choice (sequence sample_index) this update is about
    remaining: int = 1  # the job's sequences still running after this update (0: the reply is complete)


@dataclass(slots=True)
class SeqCursor:
    """How much of one of a job's sequences was handed out."""

    index: int
    sent_ids: int = 0
    sent_logprobs: int = 0


@dataclass(eq=False)
class Job:
    """One HTTP request on its way to the engine. `deliver` must be safe to call from the engine thread."""

    prompt: str | list[int]
    params: SamplingParams
    deliver: Callable[[Update], None]
    priority: int = 0
    default_max_tokens: bool = False  # max_tokens was not given: fill the context (chat's default)
    arrival: float | None = None  # when the server received it, on the engine's clock
    add_special_tokens: bool = False  # tokenize the text prompt with the tokenizer's special tokens
    req_id: int | None = None  # the first sequence's engine id
    seqs: dict[int, SeqCursor] = field(default_factory=dict)  # engine id -> cursor, while it runs


class EngineBridge:
    def __init__(self, engine, max_waiting: int | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Job] = {}  # every running sequence's engine id -> its job
        self.closed = False

    # ---- any thread ----------------------------------------------------------------
    def now(self) -> float:
        """The engine's clock (safe from any thread: it only reads a counter)."""
        return self.engine.now()

    def submit(self, job: Job) -> None:
        if self.closed:
            job.deliver(Update(REJECTED, error="the engine is stopping", code=STOPPED))
        else:
            self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        """The client left: end its request at the next step (no-op once it is done)."""
        self._inbox.put(("abort", job))

    # ---- the engine thread -------------------------------------------------------------
    def poll(self) -> None:
        while True:
            try:
                self._handle(*self._inbox.get_nowait())
            except queue.Empty:
                return

    def wait(self, timeout: float) -> None:
        """Block until something arrives or timeout passes; handle all of it."""
        try:
            self._handle(*self._inbox.get(timeout=max(0.0, timeout)))
        except queue.Empty:
            return
        self.poll()

    def _handle(self, what: str, job: Job) -> None:
        if what == "add":
            self._add(job)
        else:
            for rid in list(job.seqs):  # all n sequences: none may keep its blocks
                if self._live.pop(rid, None) is not None:
                    del job.seqs[rid]
                    self.engine.abort_request(rid, FINISH_ABORT)

    def _add(self, job: Job) -> None:
        engine = self.engine
        waiting = len(engine.scheduler.waiting)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            job.deliver(Update(REJECTED, error=f"too many requests waiting ({waiting}, the cap is "
                               f"{self.max_waiting}); retry later", code=QUEUE_FULL))
            return
        try:
            ids = engine.tokenize(job.prompt, add_special_tokens=job.add_special_tokens)
        except KvscopeError:
            ids = None  # add_request below refuses it the same way, and publishes the reject event
        code = BAD_PROMPT
        if ids is not None:
            room = engine.max_model_len - len(ids)
            if job.default_max_tokens and room > 0:
                job.params.max_tokens = room
                if job.params.min_tokens > room:
                    job.deliver(Update(REJECTED, error=f"min_tokens must be at most the rest of the context, "
                                       f"{room} tokens (got {job.params.min_tokens})", code=BAD_MIN_TOKENS))
                    return
            if 0 < room < job.params.max_tokens:
                job.deliver(Update(REJECTED, code=TOO_LONG, error=(
                    f"this model's maximum context length is {engine.max_model_len} tokens; the request asks for "
                    f"{len(ids) + job.params.max_tokens} ({len(ids)} in the prompt, {job.params.max_tokens} to "
                    f"generate)")))
                return
            if room <= 0 or len(ids) > engine.block_manager.capacity_tokens:
                code = TOO_LONG
        try:
            job.req_id = engine.add_request(ids if ids is not None else job.prompt, job.params, job.priority,
                                            source=SOURCE_HTTP, arrival_time=job.arrival)
        except RequestRejected as e:
            job.deliver(Update(REJECTED, error=str(e), code=code))
            return
        seq_ids = engine.scheduler.requests[job.req_id].seq_ids or [job.req_id]  # in sample_index order
        for index, rid in enumerate(seq_ids):
            job.seqs[rid] = SeqCursor(index)
            self._live[rid] = job
        job.deliver(Update(ACCEPTED, prompt_tokens=len(ids), token_ids=ids))

    def after_step(self, finished: list) -> None:
        """Hand every live job its new text (the engine's detokenizer settles it); finish the ended ones."""
        if not self._live:
            return
        ended = {r.req_id: r for r in finished}
        requests = self.engine.scheduler.requests
        for rid, job in list(self._live.items()):
            req = ended.get(rid) or requests.get(rid)
            if req is None:
                continue
            cur = job.seqs[rid]
            done = rid in ended
            n_out = req.num_output_tokens
            if n_out == cur.sent_ids and not done:
                continue
            new_ids = req.output_token_ids[cur.sent_ids:]
            cur.sent_ids = n_out
            logprobs = []
            if req.logprobs is not None:
                logprobs, cur.sent_logprobs = req.logprobs[cur.sent_logprobs:], len(req.logprobs)
            text = req.detokenizer.take() if req.detokenizer is not None else ""
            update = Update(DONE if done else DELTA, text, prompt_tokens=req.num_prompt_tokens,
                            completion_tokens=n_out, logprobs=logprobs, token_ids=new_ids, index=cur.index)
            if done:
                reason, error = ending(req)  # after the read: a fault it met is an error
                self._end(job, rid, update, reason, error or "")
            else:
                update.remaining = len(job.seqs)
            job.deliver(update)

    def _end(self, job: Job, rid: int, update: Update, reason: str | None, error: str = "") -> None:
        del self._live[rid]
        del job.seqs[rid]
        update.finish_reason, update.error, update.remaining = reason, error, len(job.seqs)

    def close(self) -> None:
        """The engine stops: every waiting handler gets an answer."""
        self.closed = True
        while True:
            try:
                what, job = self._inbox.get_nowait()
            except queue.Empty:
                break
            if what == "add":
                job.deliver(Update(REJECTED, error="the engine is stopping", code=STOPPED))
        for rid, job in list(self._live.items()):
            update = Update(DONE, index=job.seqs[rid].index)
            self._end(job, rid, update, FINISH_ABORT)
            job.deliver(update)

    @property
    def num_live(self) -> int:
        """Jobs with a sequence still running."""
        return len(set(map(id, self._live.values())))
