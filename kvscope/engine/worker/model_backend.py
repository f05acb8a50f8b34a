"""The model backend: the real network on torch (CPU) or Triton kernels (CUDA), on the wall clock."""

from __future__ import annotations

from kvscope.openmp_wait import prefer_short_spin_wait

prefer_short_spin_wait()  # idle OpenMP threads spin briefly, then sleep: must be decided before torch loads libgomp

import torch  # noqa: E402

from kvscope.engine.kv import budget as kv_budget
from kvscope.engine.worker import kv_sizing
from kvscope.engine.clock import WallClock
from kvscope.engine.config import EngineConfig, Mode, host_memory_bytes, usable_cores
from kvscope.engine.cpu.dtype import auto_cpu_dtype
from kvscope.engine.cpu.linear import pack_linears
from kvscope.engine.cpu.load import OtherLoad
from kvscope.engine.cpu.malloc import keep_freed_memory
from kvscope.engine.cpu.threads import (StepTuner, ThreadTuner, cost_model_price, explicit_count_tunes,
                                        thread_candidates)
from kvscope.errors import KvscopeError
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.loader.models import LoadedModel, load_model
from kvscope.engine.worker.swapper import KvSwapper

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIM_ONLY_KEYS = ("gpu", "tp", "kv_cache_dtype", "sim_efficiency", "sim_pace")


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


def choose_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The torch dtype for --dtype NAME on device, and why (the start-up line's words)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16, "auto: bfloat16 on CUDA"
        choice = auto_cpu_dtype()
        return DTYPES[choice.name], choice.reason
    if name not in DTYPES:
        raise KvscopeError(f"unknown dtype {name!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[name], "as asked"


def choose_quantization(asked: str | None, on_cuda: bool, gguf_path: str, dtype: torch.dtype) -> tuple[str | None, str]:
    """--quantization ASKED: "gguf" (the linear layers on the GGUF's own blocks) or None (dequantized), and why.

    auto takes the blocks where they are the same weights as the dense model and read faster: a GGUF on a CPU in
    float32 (the blocks widen to the very float32 values transformers dequantizes to; only the summation order
    differs) with the AVX2 or AVX-512 loops. One stream of SmolLM2 on an Ice Lake Xeon capped to AVX2 reads 92 MiB a
    token instead of 513 and its median token took 17-22 ms against 42-67 (docs/CPU.md). In bf16 (a CPU that
    multiplies bf16 in hardware) the blocks' x16 kernel multiplies the file's unrounded weights, not the dense bf16
    model's, so auto leaves that to --quantization gguf. The generic loops are no faster than float32's GEMMs."""
    if asked == "gguf":
        return "gguf", "as asked"
    if asked != "auto" or on_cuda or not gguf_path:
        return None, ""
    if dtype != torch.float32:
        return None, (f"auto: dequantized into {str(dtype).removeprefix('torch.')}; the blocks' kernel would multiply "
                      "the file's unrounded weights, which --quantization gguf asks for")
    from kvscope.kernels.cpu import gguf_linear
    from kvscope.kernels.cpu import library as cpu_attention

    cpu_attention.load()
    loops = gguf_linear.paths(torch.float32)
    if not loops or loops[0] == "generic":
        return None, "auto: dequantized, since the blocks' loops here are generic C++, no faster than float32's GEMMs"
    return "gguf", f"auto: float32 on this CPU's {gguf_linear.LOOP_NAMES[loops[0]]} loops, the same weights"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device)[0]


def default_cpu_threads(cores: int | None = None) -> int:
    """torch threads when --cpu-threads is left out: every core to start with (the runner's ThreadTuner,
    kvscope/engine/cpu/threads.py, then moves between one and every core as measured step times say).

    Measured on 2 cores with benchmarks/thread_sweep.py (benchmarks/results/threads-cpu.json): the
    second thread pays for the tiny model at full batch (serve 1.20x, bench 1.05x) and for
    a real-size one (qwen3-0.6b-shape serve 1.64x; beside a dashboard 2.28x). The one place it
    did not is the tiny model's demo beside its dashboard (0.96x), so `kvscope demo` leaves
    the dashboard a core (tui.demo.demo_threads).
    """
    return max(1, cores or usable_cores())


class ModelBackend:
    name = "model"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.torch_device = resolve_device(config.device)
        self.torch_dtype, self.dtype_reason = choose_dtype(config.dtype, self.torch_device)
        self.device = str(self.torch_device)
        self.dtype = str(self.torch_dtype).removeprefix("torch.")
        self.on_cuda = self.torch_device.type == "cuda"
        other_load = OtherLoad()  # other processes' CPU while the model loads: where the thread tuner starts
        self.model: LoadedModel = load_model(config.model, self.torch_dtype, self.device, seed=config.seed)
        if not self.on_cuda:  # oneDNN-packed weights and kept memory: see cpu_linear.py, cpu_malloc.py
            self.malloc_note = keep_freed_memory()
            packed = pack_linears(self.model.model)
            self.model.weight_bytes += packed.extra_bytes
            self.model.linear_note = packed.note
        self.quantization, why = choose_quantization(config.quantization, self.on_cuda, self.model.gguf_path,
                                                     self.torch_dtype)
        self.gguf_weights = None
        self._dense_note = self.model.linear_note
        if self.quantization == "gguf":
            try:
                self.gguf_weights = self._gguf_weights(why)
            except KvscopeError as e:
                if config.quantization == "gguf":
                    raise
                self._dequantized(f"auto: dequantized, since {e}")  # a file kvscope cannot multiply in place
        elif why:
            self._dequantized(why)
        self.cpu_threads: int | None = None
        self.thread_tuner: ThreadTuner | None = None  # without --cpu-threads on CPU: chosen online
        if not self.on_cuda:
            self.cpu_threads = config.cpu_threads or default_cpu_threads()
            torch.set_num_threads(self.cpu_threads)
            explicit = config.cpu_threads is not None
            if len(thread_candidates(self.cpu_threads)) > 1 and (not explicit or explicit_count_tunes()):
                # an explicit count is a ceiling: fewer threads only beside a competitor (cpu_threads.py)
                self.thread_tuner = ThreadTuner(thread_candidates(self.cpu_threads), torch.set_num_threads,
                                                load=other_load, only_beside_competitor=explicit)

    def _dequantized(self, why: str) -> None:
        """auto chose (or fell back to) the dense weights: the start-up line says why."""
        self.quantization, self.gguf_weights = None, None
        self.model.linear_note = f"{self._dense_note}{'; ' if self._dense_note else ''}GGUF dequantized ({why})"

    def _gguf_weights(self, why: str):
        """--quantization gguf: the GGUF's own blocks for the decoder's linear layers (gguf_blocks.py)."""
        from kvscope.engine.loader import gguf_blocks
        from kvscope.kernels.cpu import library as cpu_attention

        if self.on_cuda:
            raise KvscopeError("--quantization gguf runs on the CPU (its kernels are CPU code); leave it out on CUDA")
        if not self.model.gguf_path:
            raise KvscopeError(f"--quantization gguf needs a GGUF model (a .gguf file or smollm2-135m); "
                               f"{self.config.model!r} is not one")
        if self.torch_dtype not in (torch.float32, torch.bfloat16):
            raise KvscopeError("--quantization gguf computes in float32 or bfloat16; pick one with --dtype")
        cpu_attention.load()  # its op is in the CPU kernels' library (built once per machine)
        weights = gguf_blocks.load(self.model.gguf_path, self.model.model)
        note = weights.describe(self.torch_dtype)
        if why != "as asked":  # what a dense decode token reads: every weight but the input embedding's
            embed = self.model.model.get_input_embeddings().weight
            dense = self.model.weight_bytes - embed.numel() * embed.element_size()
            note += f"; {why}: {weights.nbytes / 2**20:,.0f} MiB a token against {dense / 2**20:,.0f} dense"
        self.model.linear_note = note
        return weights

    def kv_block_bytes(self, block_size: int) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return kv_budget.kv_bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, block_size, elem)

    def kv_budget(self) -> kv_budget.KvBudget:
        c = self.config
        if self.on_cuda:
            def make_runner(num_blocks: int) -> ModelRunner:
                return ModelRunner(self.model, device=self.torch_device, dtype=self.torch_dtype, num_blocks=num_blocks,
                                   block_size=c.block_size)

            return kv_sizing.cuda_kv_budget(
                make_runner, self.torch_device, max_len=self.model.max_position_embeddings, block_size=c.block_size,
                max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.effective_max_num_seqs,
                gpu_memory_utilization=c.gpu_memory_utilization, cuda_graphs=not c.enforce_eager)
        max_len = min(c.max_model_len or self.model.max_position_embeddings, self.model.max_position_embeddings)
        need = c.effective_max_num_seqs * kv_sizing.blocks_needed(max_len, c.block_size) * self.kv_block_bytes(
            c.block_size)
        return kv_budget.cpu_kv_budget(c.kv_cache_space, need_bytes=need,
                                       available=kv_budget.available_memory_bytes())

    def check_kv_fits(self, nbytes: int) -> None:
        """An explicit num_blocks is checked against the device's memory before the cache is allocated."""
        have = torch.cuda.mem_get_info(self.torch_device)[0] if self.on_cuda else host_memory_bytes()
        if have is not None and nbytes > have:
            raise KvscopeError(f"num_blocks {self.config.num_blocks} needs {nbytes / kv_budget.GiB:.1f} GiB of KV "
                               f"cache; {self.device} has {have / kv_budget.GiB:.1f} GiB")

    def make_runner(self, num_blocks: int, max_model_len: int) -> ModelRunner:
        c = self.config
        runner = ModelRunner(self.model, device=self.torch_device, dtype=self.torch_dtype, num_blocks=num_blocks,
                             block_size=c.block_size, scratch_tokens=max_model_len if c.mode == Mode.STATIC else 0,
                             seed=c.seed, gguf_weights=self.gguf_weights)
        if self.gguf_weights is not None and runner.decoder is None:
            if c.quantization == "gguf":
                raise KvscopeError(f"--quantization gguf runs through kvscope's CPU decoder, which is off here "
                                   f"({runner.forward_name})")
            self._dequantized(f"auto: dequantized, since kvscope's decoder is off here ({runner.forward_name})")
        if self.on_cuda and not c.enforce_eager:
            runner.capture_cuda_graphs(c.effective_max_num_seqs, max_model_len)
        if self.thread_tuner is not None:
            runner.tuner = StepTuner(self.thread_tuner, cost_model_price(self.model.model.config, self.dtype))
        return runner

    def make_swapper(self, runner: ModelRunner, num_cpu_blocks: int) -> KvSwapper:
        return KvSwapper(runner.kv_cache, num_cpu_blocks)

    def make_clock(self) -> WallClock:
        return WallClock()

    def hello_config(self, config: dict) -> dict:
        for key in SIM_ONLY_KEYS:  # the sim's settings mean nothing to a real run; keep them out of its traces
            config.pop(key, None)
        if self.on_cuda:  # lets `kvscope calibrate` find the GPU in the sim catalog
            config["device_name"] = torch.cuda.get_device_name(self.torch_device)
        else:
            config["cpu_threads"] = self.cpu_threads  # as chosen, when --cpu-threads was left out
        return config
