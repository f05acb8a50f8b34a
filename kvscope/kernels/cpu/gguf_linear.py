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
The op has loops for each kind of x86 CPU (AVX-512, AVX2 + FMA + F16C, generic C++); it runs the widest
that the CPU has under ONEDNN_MAX_CPU_ISA, and `paths` names them (tests run each).

`kernel_layout` repacks a weight for bf16 activations on a CPU with AVX-512 BF16 into the x16 layout
(types X16 + 2, 3 and 8, kvscope's own ids): 16 rows interleaved per line, so that a vector's 16 lanes
are 16 outputs (csrc/cpu_gguf.cpp's x16_line describes the bytes; `pack_x16` and `unpack_x16`
here are its torch reference). The same bytes, in another order; the op multiplies the file's exact
weights (d q + m in float32, not rounded to bf16) into float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.kernels.cpu import library as cpu_attention

BLOCK = 32  # weights per block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    nbytes: int  # one block of 32 weights
    rows: int = 1  # weight rows per row of the tensor (16 in the x16 layout)


# GGML type ids (ggml.h) that kvscope multiplies without dequantizing first: what a file may hold
FORMATS = {2: BlockFormat("Q4_0", 18), 3: BlockFormat("Q4_1", 20), 8: BlockFormat("Q8_0", 34)}
# kvscope's own ids for the types repacked into the x16 layout: never read from a file
X16 = 1000
X16_ROWS = 16
X16_FORMATS = {X16 + t: BlockFormat(f"{f.name}x16", f.nbytes, X16_ROWS) for t, f in FORMATS.items()}
DTYPES = (torch.float32, torch.bfloat16)


def format_of(ggml_type: int) -> BlockFormat:
    return FORMATS.get(ggml_type) or X16_FORMATS[ggml_type]


def in_features(blocks: torch.Tensor, ggml_type: int) -> int:
    fmt = format_of(ggml_type)
    return blocks.shape[1] // (fmt.nbytes * fmt.rows) * BLOCK


def out_features(blocks: torch.Tensor, ggml_type: int) -> int:
    return blocks.shape[0] * format_of(ggml_type).rows


def _head_bytes(ggml_type: int) -> int:  # a block's f16 d (and a Q4_1 block's f16 m)
    return 4 if ggml_type == 3 else 2


# A block's quants in a line, as axes: byte p = 64 c + 16 L + 8 h + 2 a + e holds row 4 L + a's weight
# k = 8 c + 2 h + e (4-bit: in the low nibble; the high nibble holds k + 4) or k = 4 c + 2 h + e (Q8_0).
# So the [16 rows, 32 weights] of a block, split into axes, are permuted into that order.
_ROW_AXES = ("L", "a")
_K_AXES = {8: ("c", "h", "e"), 4: ("c", "n", "h", "e")}  # by bits a weight; n: which nibble (weight k + 4n)
_SIZES = {"L": 4, "a": 4, "h": 2, "e": 2, "n": 2}
_LINE_ORDER = ("c", "L", "h", "a", "e")


def _axes(ggml_type: int) -> tuple[tuple[str, ...], list[int]]:
    """A block's [16 rows, 32 weights] as named axes, and their sizes (Q8_0 has 8 chunks c, 4-bit types 4)."""
    bits = 8 if ggml_type == 8 else 4
    sizes = {**_SIZES, "c": bits}  # 64-byte chunks a block: 16 rows x 32 weights x bits / 8 / 64
    names = _ROW_AXES + _K_AXES[bits]
    return names, [sizes[n] for n in names]


def pack_x16(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A weight [out, bytes per row] (out a multiple of 16) as x16 lines [out / 16, the same bytes x 16]: per
    block, the 16 rows' d (and m), then their quants in x16 order."""
    fmt = FORMATS[ggml_type]
    out, head = blocks.shape[0], _head_bytes(ggml_type)
    nb = blocks.shape[1] // fmt.nbytes
    b = blocks.reshape(out // X16_ROWS, X16_ROWS, nb, fmt.nbytes).transpose(1, 2)  # [lines, nb, 16, bytes]
    qs = b[..., head:]
    q = qs if ggml_type == 8 else torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [lines, nb, 16, 32]: row r's k
    names, sizes = _axes(ggml_type)
    q = q.reshape(*q.shape[:2], *sizes)
    order = _LINE_ORDER if ggml_type == 8 else _LINE_ORDER + ("n",)
    q = q.permute(0, 1, *(2 + names.index(n) for n in order))
    quants = q.reshape(*q.shape[:2], -1) if ggml_type == 8 else q[..., 0] | (q[..., 1] << 4)
    scales = [b[..., s:s + 2].reshape(*b.shape[:2], 2 * X16_ROWS) for s in range(0, head, 2)]  # d, then m
    return torch.cat([*scales, quants.reshape(*b.shape[:2], -1)], dim=-1).reshape(out // X16_ROWS, -1).contiguous()


def unpack_x16(lines: torch.Tensor, x16_type: int) -> torch.Tensor:
    """pack_x16's inverse: the blocks in the file's layout (GGML type x16_type - X16)."""
    ggml_type = x16_type - X16
    fmt = FORMATS[ggml_type]
    head = _head_bytes(ggml_type)
    count, nb = lines.shape[0], lines.shape[1] // (fmt.nbytes * X16_ROWS)
    line = lines.reshape(count, nb, fmt.nbytes * X16_ROWS)
    scales = [line[..., s * X16_ROWS:(s + 2) * X16_ROWS].reshape(count, nb, X16_ROWS, 2) for s in range(0, head, 2)]
    quants = line[..., head * X16_ROWS:]
    if ggml_type != 8:
        quants = torch.stack((quants & 0x0F, quants >> 4), dim=-1)  # axis n last
    names, sizes = _axes(ggml_type)
    order = _LINE_ORDER if ggml_type == 8 else _LINE_ORDER + ("n",)
    q = quants.reshape(count, nb, *(sizes[names.index(a)] for a in order))
    q = q.permute(0, 1, *(2 + order.index(a) for a in names)).reshape(count, nb, X16_ROWS, BLOCK)
    qs = q if ggml_type == 8 else q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    b = torch.cat([*scales, qs], dim=-1).transpose(1, 2)  # [lines, 16, nb, bytes]
    return b.reshape(count * X16_ROWS, nb * fmt.nbytes).contiguous()


def kernel_layout(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The blocks as the op multiplies them fastest for activations of `dtype` on this CPU: x16 lines where
    the op has them (bf16, whole lines of 16 rows), else as the file holds them."""
    if (dtype == torch.bfloat16 and ggml_type in FORMATS and blocks.shape[0] % X16_ROWS == 0
            and op_available() and torch.ops.kvscope.gguf_x16()):
        return pack_x16(blocks, ggml_type), X16 + ggml_type
    return blocks, ggml_type


def dequantize_reference(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] in dtype: gguf-py's float32 values, rounded once to dtype."""
    if ggml_type in X16_FORMATS:
        return dequantize_reference(unpack_x16(blocks, ggml_type), ggml_type - X16, dtype)
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


def paths(dtype: torch.dtype) -> list[str]:
    """The op's loops for activations of `dtype` on this CPU, the one it runs first ("avx512-bf16", "avx512", "avx2"
    or "generic"; csrc/cpu_gguf.cpp's gguf_paths); [] where the op is not loaded."""
    return list(torch.ops.kvscope.gguf_paths(dtype)) if op_available() and dtype in DTYPES else []


LOOP_NAMES = {"avx512-bf16": "AVX-512 BF16", "avx512": "AVX-512", "avx2": "AVX2", "generic": "generic"}


def dequantize(blocks: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype in DTYPES and op_available():
        return torch.ops.kvscope.gguf_dequantize(blocks, ggml_type, dtype)
    return dequantize_reference(blocks, ggml_type, dtype)
