"""The two backends behind one interface: `model` runs the network, `sim` prices each step on a
virtual clock. LLMEngine talks only to this interface and never asks which backend it has.

A backend is made once per engine and provides, in the order the engine asks:
- `device`, `dtype` (strings, as they appear in `hello`), `dtype_reason` and `model` (ModelInfo);
- KV sizing: `kv_block_bytes(block_size)`, `kv_budget()` (when num_blocks is not given) and
  `check_kv_fits(nbytes)` (when it is);
- `make_runner(num_blocks, max_model_len)`: computes a SchedulerOutput into sampled tokens;
- `make_swapper(runner, num_cpu_blocks)`: applies the step's swap and copy-on-write lists;
- `make_clock()`: wall time (model) or the virtual clock the sim's runner advances;
- `hello_config(config)`: the engine config as `hello` should carry it, with the backend's own keys.

To add a backend: a class with these members, a name in config.BACKENDS, and a branch in
`create_backend`. Modules are imported there, so a sim run never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvscope.engine.config import EngineConfig

if TYPE_CHECKING:
    from kvscope.engine.loader.attention_spec import AttentionSpec
    from kvscope.engine.clock import VirtualClock, WallClock
    from kvscope.engine.kv.budget import KvBudget
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.sched.output import SchedulerOutput
    from kvscope.engine.loader.tokenizer import Tokenizer


class ModelInfo(Protocol):
    """What the engine and the serve loop read about the model (LoadedModel, or the sim's SimModel)."""

    name: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    tokenizer: Tokenizer | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    attention: AttentionSpec  # per-layer sliding windows


class AttentionName(Protocol):
    name: str


class Runner(Protocol):
    ops: AttentionName  # ops.name: the attention implementation, shown in hello

    def run(self, out: SchedulerOutput, params: dict[int, SamplingParams]) -> dict[int, int]: ...


class Swapper(Protocol):
    def apply(self, swap_out: list[tuple[int, int]], copies: list[tuple[int, int]],
              swap_in: list[tuple[int, int]]) -> None: ...


class Backend(Protocol):
    name: str  # one of config.BACKENDS
    device: str  # "cpu", "cuda:0", "sim:h100-sxm5x2"
    dtype: str  # the weights' dtype: "float32", "bfloat16", ... or the sim model's "fp8", "bf16"
    dtype_reason: str  # why that dtype (start-up's line), e.g. what --dtype auto found on the CPU
    model: ModelInfo

    def kv_block_bytes(self, block_size: int) -> float: ...

    def kv_budget(self) -> KvBudget: ...

    def check_kv_fits(self, nbytes: int) -> None: ...

    def make_runner(self, num_blocks: int, max_model_len: int) -> Runner: ...

    def make_swapper(self, runner: Runner, num_cpu_blocks: int) -> Swapper: ...

    def make_clock(self) -> WallClock | VirtualClock: ...

    def hello_config(self, config: dict) -> dict: ...


def create_backend(config: EngineConfig) -> Backend:
    """The backend config.backend names (validated by EngineConfig.validate)."""
    if config.backend == "sim":
        from kvscope.engine.sim.backend import SimBackend

        return SimBackend(config)
    from kvscope.engine.worker.model_backend import ModelBackend  # torch, transformers

    return ModelBackend(config)
