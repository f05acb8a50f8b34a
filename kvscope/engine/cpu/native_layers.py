"""A decode step's layers as one C++ call (kernels/cpu/csrc/cpu_decoder.cpp, built into cpu_attention.py's library).

decoder.py's layer loop issues about 60 torch calls per layer; at SmolLM2's 30 layers of width 576
their Python and dispatch cost was about a third of a one-request step. The op
kvscope::decode_layers runs the same ATen operations in the same order from C++, so its hidden
states are the Python loop's bit for bit (tests/test_cpu_decoder.py), and a step crosses into torch
once per step instead of once per operation.

It serves steps whose rows are all decodes, on layers decoder.py could fuse and cpu_linear.py
could pack, or that run on a GGUF's blocks (gguf_blocks.py); anything else (a prefill chunk, a
model whose linear layers are not packed, the torch reference attention) runs the Python loop. KVSCOPE_DECODE_LAYERS=python forces the loop, for
comparing.

On GGUF blocks in bf16 (`fused`), the work around the GEMMs runs as cpu_decoder.cpp's one-pass
loops instead of the ATen ops: rounded at the same points, but not always the same last bit
(docs/KERNELS.md); KVSCOPE_FUSE_ELEMENTWISE=0 keeps the ATen ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvscope.engine.cpu.linear import PackedLinear
from kvscope.engine.loader.gguf_blocks import GgufLinear
from kvscope.kernels.cpu import library as cpu_attention
from kvscope.kernels.metadata import AttentionMetadata

CHOICE_ENV = "KVSCOPE_DECODE_LAYERS"  # "python": decoder.py's loop on every step
PACKED_AMX = 2000  # cpu_decoder.cpp's kPackedAmx
# cpu_decoder.cpp's kPackedDpbf16 and kDpbf16Shift: plus the weight's K blocks for one row (shifted) and for more
# (cpu_linear.use_dpbf16)
PACKED_DPBF16 = 1 << 40
DPBF16_SHIFT = 20
FUSE_ENV = "KVSCOPE_FUSE_ELEMENTWISE"  # "0": the ATen ops around the GEMMs on GGUF blocks too (for comparing)


def available() -> bool:
    """Whether the op is loaded in this process (cpu_attention.load() built or found the library)."""
    return not cpu_attention.forced_reference() and hasattr(torch.ops.kvscope, "decode_layers")


def _linear_type(m: PackedLinear | GgufLinear) -> int:
    if isinstance(m, GgufLinear):
        return m.ggml_type
    if m.dpbf16_block:
        one, more = m.dpbf16_block
        return PACKED_DPBF16 + (one << DPBF16_SHIFT) + more
    return PACKED_AMX if m.amx else 0


@dataclass(frozen=True)
class NativeLayers:
    """The layers' weights flattened in the order cpu_decoder.cpp reads them."""

    weights: list[torch.Tensor]  # per layer: input norm, qkv, o, post norm, gate_up, down (packed, or GGUF blocks)
    # per layer's qkv, o, gate_up, down: 0 oneDNN-packed; PACKED_AMX the same, decode rows on AMX tiles
    # (cpu_linear.use_amx); PACKED_DPBF16 + K blocks the same, decode rows on AVX-512 BF16 (use_dpbf16); else
    # the GGUF blocks' GGML type (or its x16 id)
    linear_types: list[int]
    optional: list[torch.Tensor | None]  # per layer: qkv, o, gate_up, down biases; q norm, k norm
    eps: list[float]  # per layer: input norm, post norm, q norm, k norm
    scaling: list[float]
    windows: list[int]  # 0: no sliding window
    q_size: int
    kv_size: int
    head_dim: int
    intermediate: int
    # every linear on GGUF blocks: in bf16 the work around the GEMMs runs as one-pass loops (cpu_decoder.cpp)
    fused: bool = False

    @classmethod
    def build(cls, layers: list, q_size: int, kv_size: int, head_dim: int,
              intermediate: int) -> tuple[NativeLayers | None, str]:
        """From decoder.py's Layer list; None and why where the op cannot run these layers."""
        if os.environ.get(CHOICE_ENV, "").strip().lower() == "python":
            return None, f"{CHOICE_ENV}=python"
        if not available():
            return None, "the CPU kernels are not loaded"
        weights, types, optional, eps, scaling, windows = [], [], [], [], [], []
        for layer in layers:
            linears = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if not all(isinstance(m, (PackedLinear, GgufLinear)) for m in linears):
                return None, f"layer {layer.index}: linear layers not packed into oneDNN's layout"
            qkv, o, gate_up, down = (m.blocks if isinstance(m, GgufLinear) else m.packed for m in linears)
            weights += [layer.input_norm.weight, qkv, o, layer.post_norm.weight, gate_up, down]
            types += [_linear_type(m) for m in linears]
            optional += [m.bias for m in linears]
            optional += [layer.q_norm and layer.q_norm.weight, layer.k_norm and layer.k_norm.weight]
            eps += [layer.input_norm.eps, layer.post_norm.eps, layer.q_norm.eps if layer.q_norm else 0.0,
                    layer.k_norm.eps if layer.k_norm else 0.0]
            scaling.append(float(layer.scaling))
            windows.append(int(layer.window or 0))
        on_blocks = all(isinstance(m, GgufLinear) for layer in layers
                        for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        fused = on_blocks and os.environ.get(FUSE_ENV, "").strip() != "0"
        return cls(weights, types, optional, eps, scaling, windows, q_size, kv_size, head_dim, intermediate,
                   fused), ""

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """hidden after every layer, or None where this step has a prefill row (the caller's loop runs it)."""
        plan = cpu_attention.decode_plan(meta)
        if plan.has_prefills or not kv_cache.is_contiguous():
            return None
        return torch.ops.kvscope.decode_layers(
            hidden, cos, signed_sin, kv_cache, meta.slot_mapping, plan.block_tables, plan.seq_lens, plan.seq_ids,
            plan.rows, self.weights, self.linear_types, self.optional, self.eps, self.scaling, self.windows,
            self.q_size, self.kv_size, self.head_dim, self.intermediate, self.fused)
