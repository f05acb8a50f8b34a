"""The llama-family forward written out, for the CPU: transformers' operations in transformers' order and
dtypes, without its per-module machinery.

A SmolLM2 decode step through transformers' model code is thousands of small torch calls, and on a
CPU each costs microseconds of Python and dispatch: at 30 layers of width 576 that host work was a
third of a one-request step. This forward walks the same modules' weights with the fewest calls
that give the same bits: q/k/v and gate/up as one packed GEMM each (cpu_linear.py), the rotary
tables once per step, the paged attention ops directly, and the final norm and lm_head on the
sampled rows only. Every operation that rounds (norms, rotary, residual adds, activations) is
transformers' own, in its order and dtype, or (a bf16 RMSNorm once the CPU kernels are loaded) a loop
that rounds where it rounds and sums in ATen's own mean, so the greedy tokens are transformers'
(tests/test_decoder.py compares logits bit for bit). A model whose structure is not exactly this (another norm, activation,
or layer type) keeps transformers' forward; `build` says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvscope.engine.loader.attention_spec import WINDOW_ATTR
from kvscope.engine.cpu.linear import fused_of
from kvscope.engine.loader.gguf_blocks import BLOCKS_MAX_ROWS, GgufLinear, GgufWeights
from kvscope.engine.cpu.native_layers import NativeLayers
from kvscope.kernels import AttentionMetadata, AttentionOps

# transformers' classes whose forward is exactly the pre-norm llama block this file computes
# (and light_llama.py's, which holds a llama checkpoint's weights under the same names)
DECODER_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer",
                  "LightDecoderLayer"}
RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "LightRMSNorm"}
FORCE_ENV = "KVSCOPE_FORWARD"  # "transformers": always run transformers' own forward (for comparing)


@dataclass(frozen=True)
class Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        """transformers' llama RMSNorm: in float32, then the weight times the input dtype's rounding.
        native: the CPU kernels are loaded, so bf16 runs kvscope::rms_norm (csrc/cpu_decoder.cpp), the same
        bits in two passes and ATen's own mean instead of seven calls."""
        if native and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return torch.ops.kvscope.rms_norm(x, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass(frozen=True)
class Layer:
    index: int
    input_norm: Norm
    qkv: torch.nn.Module | tuple  # one fused module, or the q, k, v modules
    q_norm: Norm | None  # Qwen3's per-head norms
    k_norm: Norm | None
    o_proj: torch.nn.Module
    post_norm: Norm
    gate_up: torch.nn.Module | tuple  # one fused module, or the gate and up modules
    down: torch.nn.Module
    window: int | None
    scaling: float


def _norm(module) -> Norm | None:
    if type(module).__name__ not in RMS_NORMS:
        return None
    return Norm(module.weight, module.variance_epsilon)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, in 4 calls instead of 7: rotate_half(x) is x rolled by half
    with its first half negated, and negating a factor of a product negates the rounded product exactly, so
    rolling x and negating sin's first half (signed_sin, once per step) gives the same bits."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _rope_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """_rope's bits in one pass over x, in place (kvscope::rope_, csrc/cpu_decoder.cpp): bf16 on the CPU kernels."""
    torch.ops.kvscope.rope_(x, cos, signed_sin)
    return x


class PagedDecoder:
    """One step's forward over the paged cache: packed token ids in, logits of the kept rows out."""

    def __init__(self, model: torch.nn.Module, layers: list[Layer], q_size: int, kv_size: int, head_dim: int,
                 intermediate: int, lm_head: torch.nn.Module | None = None,
                 dense_layers: list[Layer] | None = None) -> None:
        self.model = model
        self.body = model.model
        self.lm_head = lm_head if lm_head is not None else model.lm_head  # a GgufLinear under --quantization gguf
        self.layers = layers
        self.q_size, self.kv_size, self.head_dim, self.intermediate = q_size, kv_size, head_dim, intermediate
        self.final_norm = _norm(self.body.norm)
        # decode-only steps: the same layer loop as one C++ call, where the CPU kernels are loaded
        self.native, self.native_why = NativeLayers.build(layers, q_size, kv_size, head_dim, intermediate)
        # on GGUF blocks, decode steps of many rows run the C++ loop on the dense weights (gguf_blocks.py)
        self.native_dense = None
        if dense_layers is not None and self.native is not None:
            self.native_dense = NativeLayers.build(dense_layers, q_size, kv_size, head_dim, intermediate)[0]

    @property
    def name(self) -> str:
        """For the start-up line; it says so where decode steps cannot run their layers in one C++ call."""
        blocks = ", linear layers on GGUF blocks" if isinstance(self.lm_head, GgufLinear) else ""
        if self.native is not None:
            return f"kvscope decoder{blocks}"
        return f"kvscope decoder{blocks}, layers in Python ({self.native_why})"

    @classmethod
    def build(cls, model: torch.nn.Module, gguf: GgufWeights | None = None) -> tuple[PagedDecoder | None, str]:
        """The decoder for this transformers model, or None and why transformers' forward is kept. With `gguf`
        (gguf_blocks.py) its linear layers and lm_head are the GGUF's blocks instead of the model's."""
        if os.environ.get(FORCE_ENV) == "transformers":
            return None, f"{FORCE_ENV}=transformers"
        body = getattr(model, "model", None)
        cfg = model.config
        if body is None or not hasattr(body, "layers") or _norm(getattr(body, "norm", None)) is None:
            return None, f"{type(model).__name__} is not a llama-family model"
        if getattr(cfg, "hidden_act", None) != "silu":
            return None, f"activation {getattr(cfg, 'hidden_act', None)!r}"
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        for i, block in enumerate(body.layers[: cfg.num_hidden_layers]):
            if type(block).__name__ not in DECODER_LAYERS:
                return None, f"layer type {type(block).__name__}"
            attn, mlp = block.self_attn, block.mlp
            norms = [_norm(block.input_layernorm), _norm(block.post_attention_layernorm)]
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if None in norms or (q_norm is not None and _norm(q_norm) is None) or (
                    k_norm is not None and _norm(k_norm) is None):
                return None, f"layer {i}: a norm other than llama's RMSNorm"
            qkv = fused_of(attn.q_proj, attn.k_proj, attn.v_proj) or (attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = fused_of(mlp.gate_proj, mlp.up_proj) or (mlp.gate_proj, mlp.up_proj)
            layers.append(Layer(i, norms[0], qkv, q_norm and _norm(q_norm), k_norm and _norm(k_norm), attn.o_proj,
                                norms[1], gate_up, mlp.down_proj, getattr(attn, WINDOW_ATTR, None), attn.scaling))
        q_size = cfg.num_attention_heads * head_dim
        kv_size = cfg.num_key_value_heads * head_dim
        if gguf is None:
            return cls(model, layers, q_size, kv_size, head_dim, cfg.intermediate_size), ""
        on_blocks = [replace(layer, **{name: getattr(blocks, name).beside(getattr(layer, name))
                                       for name in ("qkv", "o_proj", "gate_up", "down")})
                     for layer, blocks in zip(layers, gguf.layers)]
        return cls(model, on_blocks, q_size, kv_size, head_dim, cfg.intermediate_size,
                   gguf.lm_head.beside(model.lm_head), dense_layers=layers), ""

    def _qkv(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, native: bool):
        """The layer's q and k (rotated) and v, each [T, heads, D]."""
        t, d = x.shape[0], self.head_dim
        # the projections' outputs are fresh tensors, so rotating them in place touches nothing else
        rope = _rope_in_place if native and x.dtype == torch.bfloat16 and cos.dtype == torch.bfloat16 else _rope
        if isinstance(layer.qkv, tuple):
            q, k, v = (m(x) for m in layer.qkv)
        else:
            qkv = layer.qkv(x)
            if layer.q_norm is None:  # q and k side by side in the fused output: one rotary pass for both
                qk = rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, d), cos, signed_sin)
                heads = self.q_size // d
                return qk[:, :heads], qk[:, heads:], qkv[:, self.q_size + self.kv_size :].view(t, -1, d)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q, native), layer.k_norm(k, native)
        return rope(q, cos, signed_sin), rope(k, cos, signed_sin), v

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, ops: AttentionOps) -> torch.Tensor:
        """input_ids, position_ids [1, T]; keep: the rows whose logits are wanted -> logits [len(keep), vocab]."""
        h = self.body.embed_tokens(input_ids[0])  # [T, hidden]
        cos, sin = self.body.rotary_emb(h, position_ids)  # transformers' tables, [1, T, D] in h's dtype
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]: broadcast over heads
        t, d = h.shape[0], self.head_dim
        half = d // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        if self.native is not None and ops.name == "cpu-paged":
            native = self.native if self.native_dense is None or t <= BLOCKS_MAX_ROWS else self.native_dense
            out = native.run(h, cos, signed_sin, kv_cache, meta)
            if out is not None:
                return self.lm_head(self.final_norm(out[keep]))
        native = ops.name == "cpu-paged"  # the CPU kernels' library is loaded
        for layer in self.layers:
            q, k, v = self._qkv(layer, layer.input_norm(h, native), cos, signed_sin, native)
            k_cache, v_cache = kv_cache[layer.index]
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, layer.scaling, layer.window)
            h = h + layer.o_proj(attn.reshape(t, -1))
            x = layer.post_norm(h, native)
            if isinstance(layer.gate_up, tuple):
                gate, up = (m(x) for m in layer.gate_up)
            else:
                gate, up = layer.gate_up(x).split([self.intermediate, self.intermediate], dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return self.lm_head(self.final_norm(h[keep]))
