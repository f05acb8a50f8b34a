"""The sim backend (kvscope.engine.backends.Backend): a model stand-in, KV sizing, the runner, the swapper and the
virtual clock, all priced by the cost model."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.loader.attention_spec import AttentionSpec
from kvscope.engine.clock import VirtualClock
from kvscope.errors import KvscopeError
from kvscope.engine.kv.budget import KvBudget
from kvscope.engine.sim import catalog
from kvscope.engine.sim.cost import DTYPE_BYTES, CostModel, Efficiency
from kvscope.engine.sim.runner import SimRunner
from kvscope.engine.loader.tokenizer import ByteTokenizer


def validate_sim_config(config) -> None:
    catalog.gpu(config.gpu)
    catalog.model(config.model)
    if not isinstance(config.tp, int) or config.tp < 1:
        raise KvscopeError(f"tp must be an integer >= 1, got {config.tp!r}")
    if config.kv_cache_dtype != "auto" and config.kv_cache_dtype not in DTYPE_BYTES:
        raise KvscopeError(f"unknown kv_cache_dtype {config.kv_cache_dtype!r} "
                           f"(choose from auto, {', '.join(DTYPE_BYTES)})")
    u = config.gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise KvscopeError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
    if config.sim_pace is not None and not config.sim_pace > 0:
        raise KvscopeError(f"sim_pace must be > 0, got {config.sim_pace!r}")
    if config.sim_efficiency is not None:
        try:
            eff = Efficiency.from_dict(config.sim_efficiency)
        except (TypeError, ValueError, AttributeError):
            raise KvscopeError(f"bad sim_efficiency {config.sim_efficiency!r}") from None
        if not (eff.eff_bw > 0 and eff.eff_flops > 0 and eff.overhead_s >= 0 and eff.per_seq_s >= 0):
            raise KvscopeError(f"sim_efficiency out of range: {eff.to_dict()}")


@dataclass
class SimModel:
    """Stands in for LoadedModel: the fields the engine and the serve loop read."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    tokenizer: ByteTokenizer | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention: AttentionSpec = AttentionSpec(())  # the catalog's shapes attend over their whole context


class SimBackend:
    """The cost model of a catalog GPU serving a catalog model, on a virtual clock (docs/SIM.md)."""

    name = "sim"

    def __init__(self, config) -> None:
        self.gpu = catalog.gpu(config.gpu)
        self.shape = catalog.model(config.model)
        kv_dtype = None if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        eff = Efficiency.from_dict(config.sim_efficiency) if config.sim_efficiency else Efficiency()
        self.cost = CostModel(self.gpu, self.shape, tp=config.tp, kv_dtype=kv_dtype, efficiency=eff)
        self.clock = VirtualClock(config.sim_pace)  # one clock: the runner and the swapper advance it
        self.config = config
        m = self.shape
        self.eos = m.vocab_size - 1  # the sim never produces it; it keeps workload prompts clear of the top id
        self.model = SimModel(
            name=m.name, vocab_size=m.vocab_size, max_position_embeddings=m.max_position_embeddings,
            eos_token_ids=frozenset({self.eos}),
            tokenizer=ByteTokenizer() if m.vocab_size > ByteTokenizer.NUM_BYTES else None,
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        )
        self.device = f"sim:{self.gpu.name}" + (f"x{config.tp}" if config.tp > 1 else "")
        self.dtype = m.weight_dtype
        self.dtype_reason = "the sim model's weights"

    def kv_block_bytes(self, block_size: int) -> float:
        return self.cost.kv_bytes_per_token * block_size  # per GPU: a fraction of a byte is possible under tp

    def kv_budget(self) -> KvBudget:
        util = self.config.gpu_memory_utilization
        budget = self.cost.kv_capacity_bytes(util)
        if budget < self.kv_block_bytes(self.config.block_size):
            need = self.shape.weight_bytes / self.config.tp / catalog.GiB
            have = self.gpu.memory_bytes * util / catalog.GiB
            raise KvscopeError(f"{self.shape.name} does not fit on {self.gpu.name} x{self.config.tp}: "
                               f"{need:.1f} GiB of weights per GPU, {have:.1f} GiB usable; raise --tp")
        return KvBudget(budget, f"gpu_memory_utilization {util:g} of a simulated {self.gpu.name}, less the weights")

    def check_kv_fits(self, nbytes: int) -> None:
        """A simulated pool takes no memory of this machine."""

    def make_runner(self, num_blocks: int, max_model_len: int) -> SimRunner:
        return SimRunner(self.cost, self.clock, self.shape.vocab_size, self.eos)

    def make_swapper(self, runner: SimRunner, num_cpu_blocks: int) -> "SimSwapper":
        return SimSwapper(self.cost, self.clock, self.config.block_size)

    def make_clock(self) -> VirtualClock:
        return self.clock

    def hello_config(self, config: dict) -> dict:
        c = self.cost
        config.update({
            "backend": "sim",
            "gpu": self.gpu.name,
            "sim_model": self.shape.name,
            "tp": self.config.tp,
            "kv_cache_dtype": c.kv_dtype,
            "weight_dtype": self.shape.weight_dtype,
            "gpu_memory_utilization": self.config.gpu_memory_utilization,
            "sim_efficiency": c.eff.to_dict(),
        })
        return config


class SimSwapper:
    """Bills swap and copy-on-write block copies on the virtual clock: swaps cross the host link
    (PCIe), copy-on-write copies read and write HBM."""

    def __init__(self, cost: CostModel, clock: VirtualClock, block_size: int) -> None:
        self.cost = cost
        self.clock = clock
        self.block_bytes = cost.kv_bytes_per_token * block_size
        self.blocks_copied = 0

    def apply(self, swap_out, copies, swap_in) -> None:
        gpu = self.cost.gpu
        host = (len(swap_out) + len(swap_in)) * self.block_bytes / gpu.host_bw
        local = 2 * len(copies) * self.block_bytes / (gpu.memory_bw * self.cost.eff.eff_bw)
        self.blocks_copied += len(swap_out) + len(swap_in) + len(copies)
        self.clock.advance(host + local)


def load_efficiency(path: str) -> dict:
    """Efficiencies from a `kvscope calibrate --json` file (its "efficiency" key) or a plain JSON object."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as e:
        raise KvscopeError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise KvscopeError(f"invalid JSON in {path}: {e}") from None
    eff = obj.get("efficiency", obj) if isinstance(obj, dict) else None
    if not isinstance(eff, dict):
        raise KvscopeError(f"{path} holds no efficiency object")
    return eff
