"""Linear layers over a GGUF file's quantized blocks: the C++ op (csrc/cpu_gguf.cpp) and its torch reference.

A weight stays as the file holds it: [out_features, in_features / 32 * block bytes] uint8, each row
of the matrix its blocks of 32 weights in order (ggml's layout). The block formats, from ggml's
ggml-common.h, with gguf-py's dequantization (what transformers loads a GGUF with):

  Q4_0  18 bytes: f16 d, 16 bytes of nibbles                 w = d * (q - 8)
  Q4_1  20 bytes: f16 d, f16 m, 16 bytes of nibbles          w = d * q + m
  Q8_0  34 bytes: f16 d, 32 int8                             w = d * q

(a byte's low nibble is weight j, its high nibble weight j + 16). The weights are computed in float32
and rounded to the activations' dtype, as a model dequantized into that dtype holds them; the C++ op
then multiplies in float32. `linear` uses the op where the library is loaded, else the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.kernels import cpu_attention

BLOCK = 32  # weights per block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    nbytes: int  # one block of 32 weights


# GGML type ids (ggml.h) that kvscope multiplies without dequantizing first
FORMATS = {2: BlockFormat("Q4_0", 18), 3: BlockFormat("Q4_1", 20), 8: BlockFormat("Q8_0", 34)}
DTYPES = (torch.float32, torch.bfloat16)


def in_features(blocks: torch.Tensor, ggml_type: int) -> int:
    return blocks.shape[1] // FORMATS[ggml_type].nbytes * BLOCK


def dequantize_reference(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] in dtype: gguf-py's float32 values, rounded once to dtype."""
    fmt = FORMATS[ggml_type]
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, fmt.nbytes)
    d = b[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [out, nb, 1]
    if ggml_type == 8:
        w = d * b[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        start = 4 if ggml_type == 3 else 2
        qs = b[..., start:].to(torch.int32)
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
        if ggml_type == 2:
            w = d * (q - 8).to(torch.float32)
        else:
            m = b[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
            w = d * q.to(torch.float32) + m
    return w.reshape(out, -1).to(dtype)


def linear_reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_reference(blocks, ggml_type, x.dtype), bias)


def op_available() -> bool:
    return not cpu_attention.forced_reference() and hasattr(torch.ops.kvscope, "gguf_linear")


def linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias with W held as blocks: the C++ op on a CPU where it is loaded, else the reference."""
    if x.device.type == "cpu" and x.dtype in DTYPES and op_available():
        return torch.ops.kvscope.gguf_linear(x, blocks, ggml_type, bias)
    return linear_reference(x, blocks, ggml_type, bias)


def dequantize(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype in DTYPES and op_available():
        return torch.ops.kvscope.gguf_dequantize(blocks, ggml_type, dtype)
    return dequantize_reference(blocks, ggml_type, dtype)
