"""The engine loop: schedule, run, update, publish. One call to step() is one iteration."""

from __future__ import annotations

import math
import time

from kvscope.engine import isolation, outputs, telemetry
from kvscope.engine.backends import Backend, create_backend
from kvscope.engine.kv.block_manager import BlockManager
from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.config import MAX_NUM_BLOCKS, PREEMPT_SWAP, EngineConfig
from kvscope.errors import KvscopeError
from kvscope.engine.errors import RequestRejected
from kvscope.engine.kv.events import BlockDeltaFold
from kvscope.engine.kv.budget import GiB, KvBudget, num_blocks_for
from kvscope.engine.request import Request, priority_problem
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched import external_scheduler
from kvscope.engine.sched.scheduler import Scheduler
from kvscope.engine.loader.tokenizer import HFTokenizer
from kvscope.protocol.engine_info import WIRE_ORDER
from kvscope.protocol.events import PROTOCOL_VERSION, ByeEvent, HelloEvent, OutputText, RejectEvent, SnapshotEvent
from kvscope.protocol.sinks import EventSink

__all__ = ["EventSink", "LLMEngine"]

# how much of a prompt or a completion an event carries as text (the detail screen shows a few lines)
EVENT_TEXT_TOKENS = 1024
EVENT_TEXT_CHARS = 4000


class _ParamsOf:
    """req_id -> SamplingParams of the scheduler's requests, looked up only for the rows a runner samples."""

    __slots__ = ("_requests", "_eos")

    def __init__(self, requests: dict[int, Request], eos_token_ids: frozenset[int]) -> None:
        self._requests = requests
        self._eos = eos_token_ids

    def __getitem__(self, req_id: int) -> SamplingParams:
        return self._requests[req_id].params

    def suppressed(self, req_id: int) -> list[int] | None:
        """Tokens this request may not sample now: EOS and its stop ids until min_tokens are out."""
        req = self._requests[req_id]
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            return None
        return [*(() if p.ignore_eos else self._eos), *p.stop_token_ids] or None


class LLMEngine:
    def __init__(self, config: EngineConfig, sink: EventSink | None = None, snapshot_every: int = 200,
                 snapshot_interval_s: float = 2.0) -> None:
        config.validate()
        self.config = config
        self.backend: Backend = create_backend(config)
        self.device, self.dtype, self.loaded = self.backend.device, self.backend.dtype, self.backend.model
        self.tokenizer = self.loaded.tokenizer
        # prompts and completions go into the events as text only for a real tokenizer (not byte soup)
        self._text_tokenizer = self.tokenizer if isinstance(self.tokenizer, HFTokenizer) else None
        block_bytes = self.backend.kv_block_bytes(config.block_size)
        if config.num_blocks:
            self.kv_budget = KvBudget(int(config.num_blocks * block_bytes), "num_blocks")
            self.backend.check_kv_fits(self.kv_budget.bytes)  # before the cache is allocated
            num_blocks = config.num_blocks
        else:
            self.kv_budget = self.backend.kv_budget()
            num_blocks = min(MAX_NUM_BLOCKS, num_blocks_for(self.kv_budget, block_bytes))
        self.kv_cache_bytes = int(num_blocks * block_bytes)
        # vLLM's block 0 is its null block: one block fewer holds tokens under --scheduler vllm
        usable_blocks = num_blocks - 1 if config.scheduler == "vllm" else num_blocks
        self.max_model_len = self._max_model_len(usable_blocks * config.block_size)
        num_cpu_blocks = int(int(config.swap_space * GiB) // block_bytes) if config.preemption == PREEMPT_SWAP else 0
        if config.scheduler == "vllm":  # vLLM's own scheduler and KV-cache manager decide every step
            self.scheduler = external_scheduler("vllm")(config, num_blocks, self.max_model_len)
            self.block_manager = self.scheduler.bm
        else:
            # blocks outside the window are freed only when every layer slides (a hybrid model masks only)
            self.block_manager = BlockManager(num_blocks, config.block_size, enable_caching=config.prefix_caching,
                                              sliding_window=self.loaded.attention.uniform_window,
                                              salt=f"{config.model}|{self.dtype}|{config.block_size}".encode())
            self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, num_cpu_blocks=num_cpu_blocks)
        # the block manager's queue of what changed, drained once per step: the step event's block
        # deltas come from it, and so does every consumer here (the vLLM KV-event publisher)
        self.block_deltas = BlockDeltaFold(num_blocks)
        self.kv_event_consumers: list = []
        self.runner = self.backend.make_runner(num_blocks, self.max_model_len)
        # swap-out / copy-on-write / swap-in copies, applied before each forward
        self.swapper = self.backend.make_swapper(self.runner, num_cpu_blocks)
        self.sink: EventSink | None = None
        # hello.config keys the engine does not own but its run carries (the SLO: slo_ttft_ms, ...);
        # set by the command before a sink is attached (docs/GOODPUT.md)
        self.hello_extra: dict = {}
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self._last_snapshot_t = 0.0
        self._next_id = 0
        self._to_abort: list[tuple[int, str]] = []  # (req_id, reason), applied at the start of the next step
        self.reset_counters()
        self.wall_start = time.time()
        self.clock = self.backend.make_clock()  # wall time starts once the model is loaded
        if sink is not None:
            self.attach(sink)

    def attach(self, sink: EventSink) -> None:
        """Start publishing events to sink, opening with hello and a snapshot of the current state."""
        self.sink = sink
        sink.publish(self.hello())
        sink.publish(self.snapshot())

    # ---- sizing --------------------------------------------------------------
    def _max_model_len(self, capacity_tokens: int) -> int:
        limit = self.loaded.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is not None and wanted > limit:
            raise KvscopeError(f"max_model_len {wanted} exceeds the model's limit of {limit} positions")
        return min(wanted or limit, capacity_tokens)

    # ---- public API ------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def now(self) -> float:
        return self.clock.now()

    def hello(self) -> HelloEvent:
        config = self.config.to_dict()
        config.update(device=self.device, dtype=self.dtype, num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                      kv_cache_bytes=self.kv_cache_bytes, attention=self.runner.ops.name)
        quantization = getattr(self.backend, "quantization", None)  # as resolved: "gguf", or None (dequantized)
        if quantization is None:  # dequantized weights: the key is left out
            config.pop("quantization", None)
        else:
            config["quantization"] = quantization
        config["engine"] = "kvscope"
        if config.get("scheduler") == "vllm":
            config.update(self.scheduler.hello_config())  # vLLM's version, and its null block
        config = self.backend.hello_config(config)
        config.update(self.hello_extra)
        # in the order hello.config goes on the wire (docs/PROTOCOL.md)
        ordered = {k: config[k] for k in WIRE_ORDER if k in config}
        return HelloEvent(PROTOCOL_VERSION, ordered, self.wall_start)

    def _text(self, token_ids: list[int], tail: bool = False) -> str:
        """Token ids as text for an event, cut to EVENT_TEXT_CHARS (a prompt keeps its end: the question)."""
        ids = token_ids[-EVENT_TEXT_TOKENS:] if tail else token_ids[:EVENT_TEXT_TOKENS]
        text = self._text_tokenizer.decode(ids)
        return text[-EVENT_TEXT_CHARS:] if tail else text[:EVENT_TEXT_CHARS]

    def _text_grown(self, sampled_reqs: list[Request]) -> list[OutputText]:
        """What each unfinished request's completion grew by this step (request detail streams it), up to
        EVENT_TEXT_CHARS per request; a finished request's whole text goes in ``outputs`` instead."""
        grown = []
        for r in sampled_reqs:
            detok = r.detokenizer
            if detok is None or r.finish_reason is not None or r.event_text_chars >= EVENT_TEXT_CHARS:
                continue
            piece = detok.peek(r.event_text_chars)[:EVENT_TEXT_CHARS - r.event_text_chars]
            if piece:
                r.event_text_chars += len(piece)
                grown.append(OutputText(r.req_id, piece))
        return grown

    def describe_model(self) -> str:
        """One line for start-up: the model, the dtype its weights run in, and their memory."""
        describe = getattr(self.loaded, "describe", None)  # the real model's LoadedModel; the sim has none
        if not describe:
            return f"model {self.loaded.name} ({self.backend.name}, {self.dtype})"
        forward = getattr(self.runner, "forward_name", None)  # decoder.py's forward, or why transformers' runs
        return describe(self.dtype) + (f"; forward: {forward}" if forward else "")

    def describe_dtype(self) -> str:
        """One line for start-up: the dtype the weights run in, and why (what --dtype auto found)."""
        return f"dtype {self.dtype} on {self.device} ({self.backend.dtype_reason})"

    def describe_kv_cache(self) -> str:
        """One line for start-up: the KV cache's size and how it was chosen."""
        return (f"KV cache {self.kv_cache_bytes / GiB:.2f} GiB on {self.device}: {self.num_blocks} blocks of "
                f"{self.config.block_size} tokens ({self.kv_budget.how})")

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        """Text -> ids (with the tokenizer's special tokens, e.g. BOS, if asked); ids are checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvscopeError(f"model {self.config.model!r} has no tokenizer; pass token ids instead of text")
            if add_special_tokens:
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise KvscopeError("a prompt must be a string or a list of token ids")
        vocab = self.loaded.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise KvscopeError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival: float | None = None, source: str = "", *, arrival_time: float | None = None) -> int:
        """Queue a request; raises RequestRejected (after publishing a reject) if it cannot be served.

        `arrival_time` (vLLM's name; `arrival` is the same) is when the request arrived on this engine's
        clock (`now()`), e.g. when an HTTP server received it; TTFT, queue time and e2e count from it.
        """
        req_id = self._next_id
        self._next_id += 1
        arrival = arrival_time if arrival_time is not None else arrival
        arrival = self.now() if arrival is None else arrival
        try:
            params.validate()
            bad_priority = priority_problem(priority)
            if bad_priority:
                raise KvscopeError(bad_priority)
            if not isinstance(arrival, (int, float)) or not math.isfinite(arrival):
                raise KvscopeError(f"arrival must be a finite number of seconds, got {arrival!r}")
            token_ids = self.tokenize(prompt)
            self._check_fits(token_ids)
            self._check_sampling(params)
        except KvscopeError as e:
            if self.sink is not None:
                self.sink.publish(RejectEvent(req_id, str(e), self.now()))
            raise RequestRejected(str(e)) from None
        req = Request(req_id, token_ids, params, arrival, priority, source=source)
        self.scheduler.add(req)
        samples = [req.fork(self._take_id(), i) for i in range(1, params.n)]  # n > 1: parallel sampling
        if samples:
            self.scheduler.add_forks(req, samples)
        for r in (req, *samples):
            if params.detokenize and self.tokenizer is not None:
                r.detokenizer = detok = IncrementalDetokenizer(self.tokenizer, r.params, token_ids)
                if not detok.stop:  # no stop string to look for: decode only when the text is read
                    detok.follow(r.token_ids, r.num_prompt_tokens)
        if self.sink is not None:
            prompt_text = self._text(token_ids, tail=True) if self._text_tokenizer else None
            for r in (req, *samples):
                self.sink.publish(telemetry.request_event(r, prompt_text))
        return req_id

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _check_fits(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise KvscopeError("empty prompt")
        capacity = self.block_manager.capacity_tokens
        if n > capacity:
            raise KvscopeError(f"prompt of {n} tokens does not fit in the KV cache ({capacity} tokens)")
        if n >= self.max_model_len:
            raise KvscopeError(f"prompt of {n} tokens leaves no room to generate within max_model_len {self.max_model_len}")

    def _check_sampling(self, params: SamplingParams) -> None:
        vocab = self.loaded.vocab_size
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise KvscopeError(f"stop token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if params.logprobs is not None and not hasattr(self.runner, "logprobs"):
            raise KvscopeError(f"logprobs need logits: the {self.config.backend} backend computes none")
        if params.stop and self.tokenizer is None:
            raise KvscopeError(f"stop strings need a tokenizer; model {self.config.model!r} has none")

    def abort_request(self, req_id: int, reason: str = "abort") -> None:
        """End a request at the next step (finish reason `reason`); unknown or finished ids are ignored."""
        self._to_abort.append((req_id, reason))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._to_abort)

    def step(self) -> list[Request]:
        """One iteration; returns the requests that finished in it (aborted ones first)."""
        sched = self.scheduler
        t_start = self.now()
        aborted = [r for r in (sched.abort(rid, t_start, why) for rid, why in self._to_abort) if r is not None]
        self._to_abort = []
        out = sched.schedule(t_start)
        if out.has_copies:
            self.swapper.apply(out.blocks_to_swap_out, out.blocks_to_copy, out.blocks_to_swap_in)
        sampled, failures = isolation.run_isolated(self.runner, out, _ParamsOf(sched.requests,
                                                                                 self.loaded.eos_token_ids))
        t_end = self.now()
        # a request whose inputs, forward or sampling failed ends here, alone (finish reason "error")
        failed = isolation.end_failed(sched, out, failures, t_end)
        # for the step event and the outputs; looked up before update() releases the finished ones
        sampled_reqs = [sched.requests[r] for r in sampled]
        finished = aborted + failed + sched.update(out, sampled, t_end, self.loaded.eos_token_ids)
        finished += outputs.after_update(sched, sampled_reqs, finished, getattr(self.runner, "logprobs", None),
                                         t_end)
        self.num_preemptions += len(out.preempted)
        kv_events = self.block_manager.take_events()
        deltas = self.block_deltas.fold(kv_events)
        for consume in self.kv_event_consumers:
            consume(kv_events)
        kv = sched.kv_counters()
        allocated = kv.used * self.config.block_size
        if allocated:
            self._waste_sum += (kv.tail_waste + kv.reserve_waste) / allocated
            self._waste_steps += 1
        if self.sink is not None:
            dropped = getattr(self.sink, "take_dropped", lambda: 0)()
            texts = growing = None
            if self._text_tokenizer:
                texts = [OutputText(r.req_id, self._text(r.output_token_ids)) for r in finished]
                growing = self._text_grown(sampled_reqs)
            event = telemetry.step_event(out, sched, sampled_reqs, finished, deltas, kv, t_start, t_end,
                                         dropped, texts)
            if growing is not None:
                event.text = growing
            self.sink.publish(event)
            if out.step % self.snapshot_every == 0 or t_end - self._last_snapshot_t >= self.snapshot_interval_s:
                self.publish_snapshot()
        return finished

    def reset_counters(self) -> None:
        """Zero the run totals (preemptions, KV waste), e.g. after a warm-up request."""
        self.num_preemptions = 0
        self._waste_sum = 0.0
        self._waste_steps = 0

    @property
    def mean_kv_waste(self) -> float:
        """Empty slots in allocated blocks, as a fraction, averaged over steps."""
        return self._waste_sum / self._waste_steps if self._waste_steps else 0.0

    def publish_snapshot(self) -> None:
        """A snapshot, then hello again, so a subscriber that joined late learns the whole picture."""
        if self.sink is not None:
            self.sink.publish(self.snapshot())
            self.sink.publish(self.hello())
            self._last_snapshot_t = self.now()

    def snapshot(self) -> SnapshotEvent:
        return telemetry.snapshot_event(self.scheduler, self.block_manager, self.block_deltas.view,
                                        self.scheduler.step_count, self.now())

    def close(self, reason: str = "drained") -> None:
        if self.sink is not None:
            self.sink.publish(ByeEvent(self.scheduler.step_count, self.now(), reason))
