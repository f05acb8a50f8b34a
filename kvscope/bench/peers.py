"""The peers `kvscope bench` compares against, run on the same model and requests in the same process."""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from kvscope.bench.harness import Row
from kvscope.engine.config import EngineConfig
from kvscope.engine.worker.model_backend import default_cpu_threads, resolve_device, resolve_dtype
from kvscope.engine.loader.gguf import is_gguf_path, load_gguf
from kvscope.engine.loader.models import build_builtin
from kvscope.engine.loader.named_models import NAMED_MODELS, fetch
from kvscope.engine.loader.shapes import BUILTIN_SHAPES


def _hf_model(config: EngineConfig):
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.model in BUILTIN_SHAPES:
        model = build_builtin(config.model, dtype=dtype, device=str(device), seed=config.seed)
    elif config.model in NAMED_MODELS or is_gguf_path(config.model):
        model = _gguf_peer_model(config.model, dtype, device)
    else:
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, local_files_only=True).to(device)
    if device.type == "cpu":  # the thread count kvscope's rows ran with
        torch.set_num_threads(config.cpu_threads or default_cpu_threads())
    return model.eval(), device


def _gguf_peer_model(name: str, dtype, device):
    """transformers' model of a GGUF (the load kvscope's rows made, copied), on transformers' own attention."""
    import copy

    path = fetch(name) if name in NAMED_MODELS else name
    model = copy.deepcopy(load_gguf(path, dtype, str(device))[0])
    model.set_attn_implementation("sdpa")  # the engine's rows switched the shared load to paged attention
    return model


class _StepClock:
    """A logits processor that only notes when each decoding step produced its token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def hf_static(config: EngineConfig, items) -> Row:
    """generate() on padded static batches of max_num_seqs, in arrival order, until the longest ends."""
    model, device = _hf_model(config)
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else 0
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    reserved = used = 0
    _ = model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)  # warm-up
    start = time.perf_counter()
    for i in range(0, len(items), config.max_num_seqs):
        batch = items[i : i + config.max_num_seqs]
        width = max(len(it.prompt) for it in batch)
        ids = torch.tensor([[pad] * (width - len(it.prompt)) + it.prompt for it in batch], device=device)
        mask = torch.tensor([[0] * (width - len(it.prompt)) + [1] * len(it.prompt) for it in batch], device=device)
        longest = max(it.max_tokens for it in batch)
        clock = _StepClock()
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                       pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        for it in batch:
            mine = clock.times[: it.max_tokens]
            ttft.append(mine[0] - start)
            itl.extend(b - a for a, b in zip(mine, mine[1:]))
            tokens += it.max_tokens
            used += len(it.prompt) + it.max_tokens
        reserved += len(batch) * (width + longest)
    span = time.perf_counter() - start
    return Row.from_samples("hf-static", ttft, itl, tokens, span, kv_waste=1 - used / reserved if reserved else None)


# no_grad, not inference_mode: the manager's worker thread updates tensors made here in place, and
# transformers 5.17 on CUDA refused that for inference tensors (the H200 check failed so).
@torch.no_grad()
def hf_generate_batch(config: EngineConfig, items, time_limit_s: float | None = None) -> Row:
    """transformers' continuous batching: the manager behind generate_batch, with per-request max_new_tokens.

    time_limit_s: stop after this long and report the requests finished by then (the row says
    `partial` and how many). A manager whose generation thread has died raises at once instead of
    waiting for results that cannot come."""
    model, device = _hf_model(config)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(it.max_tokens for it in items),
                           eos_token_id=None, pad_token_id=model.generation_config.pad_token_id or 0)
    model.generate_batch(inputs=[[1, 2, 3]], generation_config=gen, max_new_tokens=2)  # warm-up
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    deadline = time.monotonic() + (3600 if time_limit_s is None else max(0.0, time_limit_s))
    alive = getattr(manager, "is_running", lambda: True)
    try:
        for n, it in enumerate(items):
            manager.add_request(it.prompt, request_id=f"r{n}", max_new_tokens=it.max_tokens, record_timestamps=True)
        results = {}
        while len(results) < len(items) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not alive():
                raise RuntimeError(f"transformers' generation thread stopped after {len(results)} of {len(items)} "
                                   f"requests (its log says why)")
    finally:
        manager.stop(block=True)
    span = max((o.timestamps[-1] for o in results.values() if o.timestamps), default=start) - start
    ttft = [o.timestamps[0] - start for o in results.values() if o.timestamps]
    itl = [b - a for o in results.values() if o.timestamps for a, b in zip(o.timestamps, o.timestamps[1:])]
    tokens = sum(len(o.generated_tokens) for o in results.values())
    extra = {} if len(results) == len(items) else {"partial": True, "finished_requests": len(results),
                                                     "num_requests": len(items)}
    return Row.from_samples("hf-generate-batch", ttft, itl, tokens, span, **extra)


def llama_cpp(config: EngineConfig, items) -> Row:
    """llama.cpp on the same GGUF file, one request at a time (kvscope/bench/llama_peer.py), same threads."""
    from kvscope.bench.llama_peer import llama_cpp_row

    return llama_cpp_row(config, items, config.cpu_threads or default_cpu_threads())


def llama_cpp_16bit(kind: str) -> Callable[[EngineConfig, list], Row]:
    """llama.cpp on a 16-bit copy of the same GGUF (kvscope/bench/gguf16.py): the weights kvscope computes with,
    so both read the same bytes per token."""
    def run(config: EngineConfig, items) -> Row:
        from kvscope.bench.llama_peer import llama_cpp_row

        return llama_cpp_row(config, items, config.cpu_threads or default_cpu_threads(), sixteen_bit=kind)

    return run


def check_llama_cpp(config: EngineConfig) -> None:
    from kvscope.bench.llama_peer import check_available, gguf_path

    check_available()
    gguf_path(config)


def llama_server(config: EngineConfig, items) -> Row:
    """llama.cpp's server on the same GGUF file, every request at once over its parallel slots
    (kvscope/bench/llama_server_peer.py), same threads."""
    from kvscope.bench.llama_server_peer import llama_server_row

    return llama_server_row(config, items, config.cpu_threads or default_cpu_threads())


def check_llama_server(config: EngineConfig) -> None:
    from kvscope.bench.llama_server_peer import check_available

    check_available(config)


def vllm(config: EngineConfig, items, reference: dict | None = None) -> Row:
    """A real vLLM server (its CPU build, .venv-vllm) on the same checkpoint, every request at once over its API
    (kvscope/bench/vllm_peer.py), same threads; its greedy tokens set beside kvscope's (reference)."""
    from kvscope.bench.vllm_peer import vllm_row

    return vllm_row(config, items, config.cpu_threads or default_cpu_threads(), reference)


def check_vllm(config: EngineConfig) -> None:
    from kvscope.bench.vllm_peer import check_available

    check_available(config)


PEERS: dict[str, Callable[[EngineConfig, list], Row]] = {"hf-static": hf_static, "hf-generate-batch": hf_generate_batch,
                                                         "llama-cpp": llama_cpp, "llama-cpp-bf16": llama_cpp_16bit("bf16"),
                                                         "llama-cpp-f16": llama_cpp_16bit("f16"), "llama-server": llama_server,
                                                         "vllm": vllm}
DEFAULT_PEERS = ("hf-static", "hf-generate-batch")  # the llama.cpp peers are optional extras
# Checked before any row runs, so a missing extra costs seconds, not the minutes of the rows before it.
PEER_CHECKS: dict[str, Callable[[EngineConfig], None]] = {"llama-cpp": check_llama_cpp,
                                                          "llama-cpp-bf16": check_llama_cpp,
                                                          "llama-cpp-f16": check_llama_cpp,
                                                          "llama-server": check_llama_server,
                                                          "vllm": check_vllm}
REFERENCE_PEERS = ("vllm",)  # peers that compare their greedy tokens with kvscope's first row


def peer_step_shapes(peer: str, items, config: EngineConfig):
    """A peer's steps for the roofline, where its schedule is known from the outside; None where not
    (generate_batch's scheduler decides its own batches; llama.cpp's 4-bit weights are not this model's bytes)."""
    from kvscope.bench import roofline

    if peer == "hf-static":
        return roofline.hf_static_shapes(items, config.max_num_seqs)
    return None
