"""Build vLLM's own V1 ``Scheduler`` (and its ``KVCacheManager``) in-process, without a GPU.

vLLM 0.33 is installed without its dependencies (``make vllm``); only its scheduler's pure-Python
imports are needed. ``build_scheduler`` makes the same objects ``vllm serve``'s engine core makes,
from kvscope's settings under vLLM's names, over a KV pool of ``num_blocks`` blocks (block 0 is
vLLM's null block, so ``num_blocks - 1`` are usable).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from kvscope.errors import KvscopeError

VLLM_VERSION = "0.33.0"  # the version checked (docs/VLLM.md); `make vllm` installs it
INSTALL_HINT = "make vllm  (pip install --no-deps vllm==0.33.0 plus the pinned packages its scheduler imports)"


class VllmMissing(KvscopeError):
    """vLLM (or a package its scheduler imports) is not installed."""


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return None


def require_vllm() -> None:
    """Import vLLM's scheduler, or raise VllmMissing with the one line that says how to install it."""
    if vllm_version() is None:
        raise VllmMissing(f"--scheduler vllm needs vLLM {VLLM_VERSION}, which is not installed: run {INSTALL_HINT}")
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except ImportError as e:
        raise VllmMissing(f"--scheduler vllm: vLLM's scheduler cannot be imported ({e}): run {INSTALL_HINT}") from None


@dataclass(frozen=True, slots=True)
class VllmSchedulerSettings:
    """kvscope's flags under vLLM's names."""

    block_size: int = 16
    num_blocks: int = 64  # vLLM's num_gpu_blocks, its null block included
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # or "priority"
    num_kv_heads: int = 2
    head_size: int = 16


_CONFIG_DIR: str | None = None


def _model_dir(max_model_len: int) -> str:
    """A config.json-only model directory: vLLM's ModelConfig reads shapes, never weights here."""
    global _CONFIG_DIR
    if _CONFIG_DIR is None:
        _CONFIG_DIR = tempfile.mkdtemp(prefix="kvscope-vllm-")
    path = os.path.join(_CONFIG_DIR, str(max_model_len))
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
           "vocab_size": 256, "max_position_embeddings": max(max_model_len, 2048), "torch_dtype": "float32",
           "rms_norm_eps": 1e-6}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _quiet_vllm_logs() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


def build_scheduler(settings: VllmSchedulerSettings) -> Any:
    """vLLM's ``Scheduler`` over a ``KVCacheManager`` of ``settings.num_blocks`` blocks."""
    _quiet_vllm_logs()
    require_vllm()
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    s = settings
    try:
        return _build(s, torch, CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig, Scheduler,
                      FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, StructuredOutputManager)
    except ValueError as e:  # vLLM's own config checks (pydantic's ValidationError is a ValueError)
        lines = [ln.strip() for ln in str(e).splitlines() if "Value error" in ln or "must" in ln]
        why = (lines[0] if lines else str(e).splitlines()[0]).replace("Value error, ", "").split(" [type=")[0]
        raise KvscopeError(f"--scheduler vllm: vLLM refuses these settings: {why}") from None


def _build(s, torch, CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig, Scheduler,  # noqa: N803
           FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, StructuredOutputManager):  # noqa: N803
    model = ModelConfig(model=_model_dir(s.max_model_len), skip_tokenizer_init=True, max_model_len=s.max_model_len,
                        dtype="float32")
    sched_cfg = SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                max_model_len=s.max_model_len, enable_chunked_prefill=s.enable_chunked_prefill,
                                long_prefill_token_threshold=s.long_prefill_token_threshold, policy=s.policy,
                                is_encoder_decoder=False)
    cache = CacheConfig(block_size=s.block_size, enable_prefix_caching=s.enable_prefix_caching)
    cache.num_gpu_blocks = s.num_blocks
    config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched_cfg,
                        device_config=DeviceConfig(device="cpu"))
    spec = FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                             dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=s.num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["layers.0"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=s.block_size, log_stats=False)


_HASHER: dict[int, Any] = {}


def block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher (sha256 over bytes, as ``vllm serve`` with prefix caching)."""
    if block_size not in _HASHER:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        _HASHER[block_size] = get_request_block_hasher(block_size, fn)
    return _HASHER[block_size]


def make_request(req_id: str, prompt: list[int], max_tokens: int, arrival: float, block_size: int,
                 priority: int = 0, ignore_eos: bool = True) -> Any:
    """A vLLM ``Request`` (greedy; kvscope samples, vLLM only schedules)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return Request(req_id, list(prompt), params, None, arrival_time=arrival, priority=priority,
                   block_hasher=block_hasher(block_size))


def runner_output(req_ids: list[str], sampled: dict[str, list[int]]) -> Any:
    """vLLM's ``ModelRunnerOutput`` for one step: the tokens sampled per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in req_ids])
