"""Engine settings, validated once at start-up with one-line errors.

Each field's metadata holds its command-line help (and, for enumerated settings,
its choices): kvscope.cli builds the engine flags from these fields, so a setting
and its default are defined here only.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvscope.errors import KvscopeError
from kvscope.protocol.events import MODES, PREEMPT_RECOMPUTE, PREEMPT_SWAP, PREEMPTION_MODES, Mode

POLICIES = ("fcfs", "sjf", "priority")  # or "module:Class" (see docs/POLICIES.md)
SCHEDULERS = ("kvscope", "vllm")  # vllm: vLLM's own V1 Scheduler (vllm/inproc/scheduler.py)
BACKENDS = ("model", "sim")  # sim: the cost model on a virtual clock (docs/SIM.md)
DTYPES = ("auto", "float32", "float16", "bfloat16")
# gguf: vLLM's --quantization value for GGUF files (engine/loader/gguf_blocks.py); auto: gguf where that is the
# faster exact path here (engine/worker/model_backend.py's choose_quantization); none: dequantize into --dtype
QUANTIZATIONS = ("auto", "gguf", "none")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp32")  # sim only
# The sim catalog's GPUs (kvscope.engine.sim.catalog.GPUS; a test keeps the two equal). Named here
# so the CLI lists them without importing the catalog, which loads torch for the built-in shapes.
SIM_GPUS = ("h100-sxm5", "h200", "a100-80gb", "a100-pcie-80gb", "a800-80gb", "rtx-4070-laptop", "l40s", "l4", "cpu")

# Caps on sizes a flag or a file can ask for, checked before anything is allocated.
MAX_NUM_BLOCKS = 1 << 21  # the block manager keeps per-block lists: ~120 MB of bookkeeping at the cap
MAX_SWAP_SPACE_GIB = 1024.0
MAX_BLOCK_SIZE = 1024
MAX_TOKENS_PER_STEP = 1 << 20  # max_num_batched_tokens, max_model_len
MAX_NUM_SEQS = 1 << 16
MAX_TP = 1024
GiB = 1 << 30


def setting(default: Any, help: str, *, choices: tuple[str, ...] | None = None, group: str = "engine",
            metavar: str | None = None) -> Any:
    """A config field with its command-line help (group "sim": shown under the sim backend's flags)."""
    meta = {"help": help, "group": group, "choices": choices, "metavar": metavar}
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model: str = setting("tiny", "tiny, qwen3-0.6b-shape, smollm2-135m (a real model, fetched once), "
                                 "a local checkpoint directory or a .gguf file; "
                                 "with --backend sim a catalog shape, e.g. llama-3.3-70b-fp8")
    device: str = setting("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = setting("auto", "weights and activations (auto: bfloat16 on CUDA and on a CPU with AMX or "
                         "avx512_bf16, else float32)",
                         choices=DTYPES)
    quantization: str | None = setting("auto", "gguf: a GGUF model's linear layers multiply the file's own quantized "
                                               "blocks on the CPU (Q4_0, Q4_1, Q8_0), reading fewer bytes per token "
                                               "than the dequantized weights; none: dequantize into --dtype; auto: "
                                               "gguf where the engine runs float32 on a CPU with the blocks' AVX2 or "
                                               "AVX-512 loops, else none (docs/CPU.md)", choices=QUANTIZATIONS)
    backend: str = setting("model", "model: run the network; sim: a cost model of --gpu on a virtual clock",
                           choices=BACKENDS, group="sim")
    mode: str = setting("chunked", "batching mode", choices=MODES)
    scheduler: str = setting("kvscope", "who decides each step: kvscope's scheduler, or vLLM's own V1 scheduler and "
                                        "KV-cache manager (docs/VLLM_SCHEDULER.md; `make vllm` installs it)",
                             choices=SCHEDULERS)
    long_prefill_token_threshold: int = setting(0, "--scheduler vllm: longest prefill chunk of one request per "
                                                   "step (0: no limit beyond the budget)")
    policy: str = setting("fcfs", "scheduling policy, or module:Class for your own (docs/POLICIES.md; "
                                  "command line only, never from a file)", choices=POLICIES + ("module:Class",))
    block_size: int = setting(16, "tokens per KV block")
    num_blocks: int | None = setting(None, "KV blocks (default: sized from memory)")
    max_num_seqs: int = setting(64, "most requests running at once")
    max_num_batched_tokens: int = setting(512, "token budget per step")
    max_model_len: int | None = setting(None, "longest prompt + output (default: the model's, capped by the KV cache)")
    seed: int = setting(0, "random seed (weights of built-in models, sampling, workloads)")
    prefix_caching: bool = setting(False, "share KV blocks of common prompt prefixes")
    preemption: str = setting("recompute", "what a preempted request loses: recompute its KV, or swap it to CPU",
                              choices=PREEMPTION_MODES)
    swap_space: float = setting(4.0, "CPU memory for swapped-out KV, in GiB", metavar="GIB")
    kv_cache_space: float | None = setting(None, "CPU: GiB for the KV cache (default: half of the available memory, "
                                                 "at most 4)", metavar="GIB")
    cpu_threads: int | None = setting(None, "torch threads on CPU (default: every core; `kvscope demo` leaves "
                                            "its dashboard one); at most this many: beside a busy process the "
                                            "runner drops to one where that is faster (KVSCOPE_FIXED_THREADS=1: "
                                            "exactly this many)")
    enforce_eager: bool = setting(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    gpu_memory_utilization: float = setting(0.9, "share of GPU memory for weights, activations and KV")
    # backend="sim" (docs/SIM.md): model is a catalog name (kvscope.engine.sim.catalog)
    gpu: str = setting("h100-sxm5", "sim: the catalog GPU", choices=SIM_GPUS, group="sim")
    tp: int = setting(1, "sim: tensor-parallel degree", group="sim")
    kv_cache_dtype: str = setting("auto", "sim: KV cache element type (auto: the model's activation dtype)",
                                  choices=KV_CACHE_DTYPES, group="sim")
    sim_efficiency: dict | None = setting(None, "sim: efficiencies and overhead from `kvscope calibrate --json "
                                                "FILE`", group="sim", metavar="FILE")
    sim_pace: float | None = setting(None, "sim: hold virtual time to X x wall time (1: real time, for a live "
                                           "dashboard)", group="sim", metavar="X")

    def validate(self) -> None:
        _check_choice("mode", self.mode, MODES)
        if not isinstance(self.policy, str):
            raise KvscopeError(f"policy must be a name or 'module:Class', got {_short(self.policy)}")
        from kvscope.engine.sched.policies import load_policy

        load_policy(self.policy)  # one-line error if unknown, unimportable or not a policy
        _check_choice("backend", self.backend, BACKENDS)
        if self.quantization is not None:  # None: as "none", for callers of the Python API
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
            if self.quantization == "gguf" and self.backend == "sim":
                raise KvscopeError("--quantization gguf multiplies a GGUF model's own blocks; the sim backend runs "
                                   "no weights (leave it out)")
        _check_choice("preemption mode", self.preemption, PREEMPTION_MODES)
        _check_choice("scheduler", self.scheduler, SCHEDULERS)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, MAX_TOKENS_PER_STEP)
        if self.scheduler == "vllm":
            self._check_vllm_scheduler()
        for name in ("model", "device", "dtype", "gpu", "kv_cache_dtype"):
            if not isinstance(getattr(self, name), str):
                raise KvscopeError(f"{name} must be a string, got {_short(getattr(self, name))}")
        _check_number("swap_space", self.swap_space, 0.0, MAX_SWAP_SPACE_GIB, "GiB")
        for name in ("prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise KvscopeError(f"{name} must be true or false, got {_short(getattr(self, name))}")
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _check_int("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_TOKENS_PER_STEP)
        _check_int("seed", self.seed, 0, (1 << 63) - 1)
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1, MAX_NUM_BLOCKS)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2, MAX_TOKENS_PER_STEP)
        if self.kv_cache_space is not None:
            _check_number("kv_cache_space", self.kv_cache_space, 1e-6, MAX_SWAP_SPACE_GIB, "GiB")
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1, 4096)
        gmu = self.gpu_memory_utilization
        if not _is_number(gmu) or not 0 < gmu <= 1:
            raise KvscopeError(f"gpu_memory_utilization must be a number in (0, 1], got {_short(gmu)}")
        if self.backend == "sim":
            _check_int("tp", self.tp, 1, MAX_TP)
            if self.sim_pace is not None:
                _check_number("sim_pace", self.sim_pace, 1e-6, 1e6)
            from kvscope.engine.sim.backend import validate_sim_config

            validate_sim_config(self)
        elif self.preemption == PREEMPT_SWAP:
            host = host_memory_bytes()
            if host is not None and self.swap_space * GiB > host:
                raise KvscopeError(f"swap_space {self.swap_space:g} GiB is more than this machine's memory "
                                   f"({host / GiB:.1f} GiB)")

    def _check_vllm_scheduler(self) -> None:
        """What vLLM's V1 scheduler does not do is refused in one line."""
        if self.mode != Mode.CHUNKED:
            raise KvscopeError(f"--scheduler vllm runs vLLM's scheduler, which always chunks prefills: --mode "
                               f"{self.mode} is kvscope's own (use --mode chunked or --scheduler kvscope)")
        if self.policy not in ("fcfs", "priority"):
            raise KvscopeError(f"--scheduler vllm supports vLLM's policies fcfs and priority, not {_short(self.policy)}")
        if self.preemption != "recompute":
            raise KvscopeError("--scheduler vllm: vLLM's V1 scheduler preempts by recompute only, not swap")

    @property
    def effective_max_num_seqs(self) -> int:
        return 1 if self.mode == Mode.NAIVE else self.max_num_seqs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CONFIG_FIELDS = tuple(f.name for f in fields(EngineConfig))


def config_from_data(data: Any, where: str) -> EngineConfig:
    """An EngineConfig from a file's map (a bench preset's "engine"). Files are data: unknown keys are
    refused and the policy must be a built-in one; a module:Class policy comes from the command line only."""
    if not isinstance(data, dict):
        raise KvscopeError(f"{where} must be a map of engine settings, got {_short(data)}")
    for k in data:
        if k not in CONFIG_FIELDS:
            raise KvscopeError(f"{where}: unknown engine setting {_short(k)} (known: {', '.join(CONFIG_FIELDS)})")
    policy = data.get("policy", "fcfs")
    if policy not in POLICIES:
        raise KvscopeError(f"{where}: policy must be one of {', '.join(POLICIES)} in a file, got {_short(policy)} "
                           "(a module:Class policy can be given only with --policy)")
    config = EngineConfig(**data)
    try:
        config.validate()
    except KvscopeError as e:
        raise KvscopeError(f"{where}: {e}") from None
    return config


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def host_memory_bytes() -> int | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _short(v: Any, limit: int = 60) -> str:
    s = repr(v) if not isinstance(v, (list, dict, tuple)) or len(v) <= 8 else f"<{type(v).__name__} of {len(v)}>"
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise KvscopeError(f"{name} must be an integer in [{lo}, {hi:,}], got {_short(v)}")


def _check_number(name: str, v: Any, lo: float, hi: float, unit: str = "") -> None:
    if not _is_number(v) or not lo <= v <= hi:
        raise KvscopeError(f"{name} must be a number in [{lo:g}, {hi:g}]{' ' + unit if unit else ''}, got {_short(v)}")


def _check_choice(name: str, v: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(v, str) or v not in choices:
        raise KvscopeError(f"unknown {name} {_short(v)} (choose from {', '.join(choices)})")
