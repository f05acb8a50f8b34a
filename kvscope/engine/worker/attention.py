"""Plugs kvscope's paged attention into transformers' model code.

transformers lets a model call a registered attention function by name. Ours
ignores the dense mask and instead writes the new K/V into the paged cache and
attends over each sequence's block table. The per-step data reaches it through
a forward context set by the model runner around each forward, as in vLLM.
Each attention module carries its layer's sliding window (attention_spec.py),
set once by install().
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from kvscope.engine.loader.attention_spec import WINDOW_ATTR, attention_spec
from kvscope.kernels import AttentionMetadata, AttentionOps

ATTN_IMPLEMENTATION = "kvscope_paged"


@dataclass
class ForwardContext:
    kv_cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata
    ops: AttentionOps


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _current
    previous, _current = _current, ctx
    try:
        yield
    finally:
        _current = previous


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention signature: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    ctx = _current
    if ctx is None:
        raise RuntimeError("kvscope paged attention called outside a forward context")
    window = getattr(module, WINDOW_ATTR, None)
    if kwargs.get("sliding_window") != window:  # transformers' model code passes its own layer window
        raise RuntimeError(f"layer {module.layer_idx}: transformers asks for sliding window "
                           f"{kwargs.get('sliding_window')!r}, kvscope derived {window!r}")
    k_cache, v_cache = ctx.kv_cache[module.layer_idx]
    q = query[0].transpose(0, 1)
    ctx.ops.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, ctx.meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ctx.ops.paged_attention(q, k_cache, v_cache, ctx.meta, scale, window)
    return out.unsqueeze(0), None


def install(model: torch.nn.Module) -> None:
    """Register our attention with transformers, switch the model to it, and give each layer its window."""
    windows = attention_spec(model.config, "model").layer_windows
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and hasattr(module, "q_proj"):
            setattr(module, WINDOW_ATTR, windows[layer])
    if getattr(model, "decoder_only", False):  # light_llama.py's weights: transformers' model code never runs
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    setter = getattr(model, "set_attn_implementation", None)
    try:
        if setter is None:
            raise AttributeError
        setter(ATTN_IMPLEMENTATION)
    except (AttributeError, ValueError, TypeError):
        model.config._attn_implementation = ATTN_IMPLEMENTATION
