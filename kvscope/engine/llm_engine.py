"""The engine loop: schedule, run, update, publish. One call to step() is one iteration."""

from __future__ import annotations

import os
import time
from typing import Protocol

import torch

from kvscope.engine import telemetry
from kvscope.engine.block_manager import BlockManager
from kvscope.engine.clock import WallClock
from kvscope.engine.config import MAX_NUM_BLOCKS, EngineConfig, host_memory_bytes
from kvscope.engine.errors import KvscopeError, RequestRejected
from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models import load_model
from kvscope.engine.request import Request
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduler import Scheduler
from kvscope.engine.swap import KvSwapper
from kvscope.protocol.events import PROTOCOL_VERSION, ByeEvent, HelloEvent, RejectEvent, SnapshotEvent

CPU_KV_CACHE_BYTES = 256 << 20  # default KV budget on CPU when num_blocks is not given
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EventSink(Protocol):
    def publish(self, event) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise KvscopeError(f"unknown device {name!r} (use auto, cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KvscopeError("device 'cuda' requested but no CUDA GPU is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise KvscopeError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[name]


class _ParamsOf:
    """req_id -> SamplingParams of the scheduler's requests, looked up only for the rows a runner samples."""

    __slots__ = ("_requests",)

    def __init__(self, requests: dict[int, Request]) -> None:
        self._requests = requests

    def __getitem__(self, req_id: int) -> SamplingParams:
        return self._requests[req_id].params


class LLMEngine:
    def __init__(self, config: EngineConfig, sink: EventSink | None = None, snapshot_every: int = 200,
                 snapshot_interval_s: float = 2.0) -> None:
        config.validate()
        self.config = config
        self.sim = None  # backend "sim": kvscope.engine.sim.backend.SimBackend
        if config.backend == "sim":
            from kvscope.engine.sim.backend import SimBackend

            self.sim = SimBackend(config)
            self.device, self.dtype, self.loaded = self.sim.device, self.sim.dtype, self.sim.loaded
        else:
            self.device = resolve_device(config.device)
            self.dtype = resolve_dtype(config.dtype, self.device)
            if self.device.type == "cpu":
                # Oversubscribed OpenMP threads spin-wait: with the dashboard or event threads on the
                # same cores, a step can take 10-50x longer. Leave them a core.
                torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
            self.loaded = load_model(config.model, self.dtype, str(self.device), seed=config.seed)
        self.tokenizer = self.loaded.tokenizer
        num_blocks = config.num_blocks or self._auto_num_blocks()
        self._check_kv_fits(num_blocks)
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        # blocks outside the window are freed only when every layer slides (a hybrid model masks only)
        window = getattr(getattr(self.loaded, "attention", None), "uniform_window", None)
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_caching=config.prefix_caching,
                                          sliding_window=window)
        num_cpu_blocks = self._num_swap_blocks() if config.preemption == "swap" else 0
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, num_cpu_blocks=num_cpu_blocks)
        self.runner = self.sim.runner if self.sim else ModelRunner(
            self.loaded, device=self.device, dtype=self.dtype, num_blocks=num_blocks,
            block_size=config.block_size, scratch_tokens=self.max_model_len if config.mode == "static" else 0,
            seed=config.seed,
        )
        if self.sim is None and self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_cuda_graphs(config.effective_max_num_seqs, self.max_model_len)
        # swap-out / copy-on-write / swap-in copies, applied before each forward
        self.swapper = (self.sim.swapper(num_cpu_blocks) if self.sim
                        else KvSwapper(self.runner.kv_cache, num_cpu_blocks))
        self.sink: EventSink | None = None
        self.snapshot_every = snapshot_every
        self.snapshot_interval_s = snapshot_interval_s
        self._last_snapshot_t = 0.0
        self._next_id = 0
        self._to_abort: list[tuple[int, str]] = []  # (req_id, reason), applied at the start of the next step
        self.reset_counters()
        self.wall_start = time.time()
        # wall time starts once the model is loaded; the sim runs on its own virtual clock
        self.clock = self.sim.clock if self.sim is not None else WallClock()
        if sink is not None:
            self.attach(sink)

    def attach(self, sink: EventSink) -> None:
        """Start publishing events to sink, opening with hello and a snapshot of the current state."""
        self.sink = sink
        sink.publish(self.hello())
        sink.publish(self.snapshot())

    # ---- sizing --------------------------------------------------------------
    def _auto_num_blocks(self) -> int:
        if self.sim is not None:
            return min(MAX_NUM_BLOCKS, self.sim.num_blocks(self.config.block_size))
        per_block = ModelRunner.kv_bytes_per_block(self.loaded, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            from kvscope.engine.cuda_graphs import kv_cache_budget_bytes

            c = self.config
            budget = kv_cache_budget_bytes(
                self.loaded, self.device, self.dtype, block_size=c.block_size,
                max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.effective_max_num_seqs,
                gpu_memory_utilization=c.gpu_memory_utilization, cuda_graphs=not c.enforce_eager)
        else:
            budget = CPU_KV_CACHE_BYTES
        return min(MAX_NUM_BLOCKS, max(1, budget // per_block))

    def _check_kv_fits(self, num_blocks: int) -> None:
        """An explicit num_blocks is checked against the device's memory before the cache is allocated."""
        if self.sim is not None or self.config.num_blocks is None:
            return
        need = num_blocks * ModelRunner.kv_bytes_per_block(self.loaded, self.config.block_size, self.dtype)
        have = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else host_memory_bytes()
        if have is not None and need > have:
            raise KvscopeError(f"num_blocks {num_blocks} needs {need / (1 << 30):.1f} GiB of KV cache; "
                               f"{self.device} has {have / (1 << 30):.1f} GiB")

    def _num_swap_blocks(self) -> int:
        if self.sim is not None:
            return self.sim.num_swap_blocks(self.config.block_size)
        per_block = ModelRunner.kv_bytes_per_block(self.loaded, self.config.block_size, self.dtype)
        return int(self.config.swap_space * (1 << 30)) // per_block

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
        config.update(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                      num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                      attention=self.runner.ops.name, preemption_mode=self.config.preemption)
        if self.sim is not None:
            config.update(self.sim.hello_info())
        else:  # the sim's settings mean nothing to a real run; keep them out of its traces
            for key in ("gpu", "tp", "kv_cache_dtype", "sim_efficiency", "sim_pace"):
                config.pop(key, None)
            if self.device.type == "cuda":  # lets `kvscope calibrate` find the GPU in the sim catalog
                config["device_name"] = torch.cuda.get_device_name(self.device)
        return HelloEvent(PROTOCOL_VERSION, config, self.wall_start)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KvscopeError(f"model {self.config.model!r} has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise KvscopeError("a prompt must be a string or a list of token ids")
        vocab = self.loaded.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise KvscopeError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival: float | None = None, source: str = "") -> int:
        """Queue a request; raises RequestRejected (after publishing a reject) if it cannot be served."""
        req_id = self._next_id
        self._next_id += 1
        arrival = self.now() if arrival is None else arrival
        try:
            params.validate()
            token_ids = self.tokenize(prompt)
            self._check_fits(token_ids)
        except KvscopeError as e:
            if self.sink is not None:
                self.sink.publish(RejectEvent(req_id, str(e), self.now()))
            raise RequestRejected(str(e)) from None
        req = Request(req_id, token_ids, params, arrival, priority, source=source)
        self.scheduler.add(req)
        if self.sink is not None:
            self.sink.publish(telemetry.request_event(req))
        return req_id

    def _check_fits(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise KvscopeError("empty prompt")
        capacity = self.block_manager.capacity_tokens
        if n > capacity:
            raise KvscopeError(f"prompt of {n} tokens does not fit in the KV cache ({capacity} tokens)")
        if n >= self.max_model_len:
            raise KvscopeError(f"prompt of {n} tokens leaves no room to generate within max_model_len {self.max_model_len}")

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
        sampled = self.runner.run(out, _ParamsOf(sched.requests))
        t_end = self.now()
        # for the step event; looked up before update() releases the finished ones
        sampled_reqs = [sched.requests[r] for r in sampled] if self.sink is not None else []
        finished = aborted + sched.update(out, sampled, t_end, self.loaded.eos_token_ids)
        self.num_preemptions += len(out.preempted)
        deltas = self.block_manager.drain_deltas()
        kv = sched.kv_counters()
        allocated = kv.used * self.config.block_size
        if allocated:
            self._waste_sum += (kv.tail_waste + kv.reserve_waste) / allocated
            self._waste_steps += 1
        if self.sink is not None:
            dropped = getattr(self.sink, "take_dropped", lambda: 0)()
            self.sink.publish(telemetry.step_event(out, sched, sampled_reqs, finished, deltas, kv, t_start, t_end,
                                                   dropped))
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
        return telemetry.snapshot_event(self.scheduler, self.block_manager, self.scheduler.step_count, self.now())

    def close(self, reason: str = "drained") -> None:
        if self.sink is not None:
            self.sink.publish(ByeEvent(self.scheduler.step_count, self.now(), reason))
