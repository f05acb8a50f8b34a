"""Engine settings, validated once at start-up with one-line errors."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvscope.engine.errors import KvscopeError

MODES = ("naive", "static", "continuous", "chunked")
POLICIES = ("fcfs", "sjf", "priority")  # or "module:Class" (see docs/POLICIES.md)
PREEMPTION_MODES = ("recompute", "swap")
BACKENDS = ("model", "sim")  # sim: the cost model on a virtual clock (docs/SIM.md)


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA), "float32", "float16", "bfloat16"
    backend: str = "model"
    mode: str = "chunked"
    policy: str = "fcfs"
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory (see ModelRunner)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's limit, capped by the KV cache
    seed: int = 0
    prefix_caching: bool = False
    preemption: str = "recompute"  # or "swap": victims' KV is copied to a CPU pool and back
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks (preemption="swap")
    cpu_threads: int | None = None  # torch threads on CPU; None: half the cores, leaving room for watchers
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    # backend="sim" (docs/SIM.md): model is a catalog name (kvscope.engine.sim.catalog)
    gpu: str = "h100-sxm5"  # sim: catalog GPU
    tp: int = 1  # sim: tensor-parallel degree
    kv_cache_dtype: str = "auto"  # sim: auto (the model's activation dtype), bf16, fp16, fp8, fp32
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV (sim; shared with issue 5)
    sim_efficiency: dict | None = None  # sim: eff_bw, eff_flops, overhead_s, per_seq_s (None: catalog priors)
    sim_pace: float | None = None  # sim: hold virtual time to at most pace x wall time (1.0: real time)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise KvscopeError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if not isinstance(self.policy, str):
            raise KvscopeError(f"policy must be a name or 'module:Class', got {self.policy!r}")
        from kvscope.engine.policies import load_policy

        load_policy(self.policy)  # one-line error if unknown, unimportable or not a policy
        if self.backend not in BACKENDS:
            raise KvscopeError(f"unknown backend {self.backend!r} (choose from {', '.join(BACKENDS)})")
        if self.preemption not in PREEMPTION_MODES:
            raise KvscopeError(
                f"unknown preemption mode {self.preemption!r} (choose from {', '.join(PREEMPTION_MODES)})")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or not self.swap_space >= 0:
            raise KvscopeError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if not isinstance(self.prefix_caching, bool):
            raise KvscopeError(f"prefix_caching must be true or false, got {self.prefix_caching!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KvscopeError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise KvscopeError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise KvscopeError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise KvscopeError(f"cpu_threads must be an integer >= 1, got {self.cpu_threads!r}")
        if not isinstance(self.enforce_eager, bool):
            raise KvscopeError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
            raise KvscopeError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")
        if self.backend == "sim":
            from kvscope.engine.sim.backend import validate_sim_config

            validate_sim_config(self)

    @property
    def effective_max_num_seqs(self) -> int:
        return 1 if self.mode == "naive" else self.max_num_seqs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
