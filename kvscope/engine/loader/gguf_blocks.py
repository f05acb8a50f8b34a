"""`--quantization gguf`: the decoder's linear layers run on the GGUF file's own quantized blocks.

transformers loads a GGUF by dequantizing every weight into the engine's dtype: SmolLM2's linear
layers and tied lm_head become 269 MB of bf16, and a one-token decode step reads all of them,
so on a CPU the step costs what the memory takes to deliver those bytes. llama.cpp reads the
file's blocks as they are (97 MB for the same model in Q4_1). With this setting kvscope does
too, as vLLM does with its own `--quantization gguf`: each linear layer keeps its blocks (read
from the file once per process), and kvscope/kernels/cpu/gguf_linear.py's op widens each block in
registers as it multiplies. The weights are the values transformers' dequantizer gives: rounded
to the engine's dtype, so that only the summation order differs from the dense model's GEMM, or,
for blocks under bf16 on a CPU with AVX-512 BF16 (repacked 16 rows at a time at load: the x16 layout),
unrounded, so that the product is the exact one rounded once (tests/test_gguf_blocks.py checks the
weights and the products, tests/test_engine_gguf.py the greedy tokens).

llama.cpp's converter permutes the rows of a llama model's q and k weights (its rotary layout);
transformers' loader undoes that, and so does this module, on whole rows of blocks. Before the
blocks are used, layer 0's and the last layer's are dequantized and compared, bit for bit, with
the weights transformers loaded: a file laid out otherwise is refused in one line, not served.

The dense model stays loaded, so this costs the blocks' bytes of memory on top: a step of more
than BLOCKS_MAX_ROWS rows (a prefill chunk, a batch of decodes) is arithmetic-bound, not
bytes-bound, and runs on the dense oneDNN-packed weights as before; a step of a few rows (one
chat stream's decode) reads the blocks. The embedding lookup stays dense.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvscope.errors import KvscopeError
from kvscope.engine.loader.gguf import GgufHeader, check_servable, file_key
from kvscope.kernels.cpu import gguf_linear

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PERMUTED = ("attn_q", "attn_k")  # rows reordered by llama.cpp's converter for llama models


# Rows of input up to which the blocks are multiplied; more go to the dense weights beside them. The blocks
# cost their widening arithmetic once per 8 rows and a dot product per row; the dense GEMM costs its bytes
# until it has rows enough to be arithmetic. One pass of SmolLM2's linear layers (2 cores, AVX-512 BF16,
# benchmarks/gguf_linear.py, benchmarks/results/gguf-linear-smollm2-bf16-cpu.txt): blocks 7.0 ms against dense 14.0 at
# 1 row, 11.4 against 15.2 at 8, 19.3 against 16.9 at 12.
BLOCKS_MAX_ROWS = 8


class GgufLinear(torch.nn.Module):
    """y = x W^T with W as GGUF blocks [out_features, bytes per row] (kernels/cpu/gguf_linear.py); past
    BLOCKS_MAX_ROWS rows of input, the same weight's dense module where one is beside it."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, dense: torch.nn.Module | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.blocks = blocks  # a plain attribute: uint8, not a parameter
        self.ggml_type = ggml_type
        self.bias = bias
        self.out_features = gguf_linear.out_features(blocks, ggml_type)
        self.in_features = gguf_linear.in_features(blocks, ggml_type)
        self.dense = dense

    def beside(self, linear: torch.nn.Module | tuple) -> GgufLinear:
        """The same blocks beside the model's own layer for this weight (one module, or the separate modules
        fused here): its bias (Qwen2's q/k/v have one; the GGUF's F32 bias is what transformers loaded into
        it), and, where it is one module, the dense weight for inputs of many rows."""
        parts = linear if isinstance(linear, tuple) else (linear,)
        biases = [getattr(m, "bias", None) for m in parts]
        bias = None
        if any(b is not None for b in biases):
            dtype = next(b.dtype for b in biases if b is not None)
            bias = torch.cat([b if b is not None else torch.zeros(m.out_features, dtype=dtype)
                              for b, m in zip(biases, parts)])
        return GgufLinear(self.blocks, self.ggml_type, None if isinstance(linear, tuple) else linear, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() > BLOCKS_MAX_ROWS * self.in_features:
            return self.dense(x)
        return gguf_linear.linear(x, self.blocks, self.ggml_type, self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return gguf_linear.dequantize(self.blocks, self.ggml_type, dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{gguf_linear.format_of(self.ggml_type).name} blocks")


@dataclass(frozen=True)
class LayerLinears:
    qkv: GgufLinear  # q, k, v rows in that order
    o_proj: GgufLinear
    gate_up: GgufLinear  # gate rows, then up rows
    down: GgufLinear

    def linears(self) -> tuple[GgufLinear, ...]:
        return self.qkv, self.o_proj, self.gate_up, self.down


@dataclass(frozen=True)
class GgufWeights:
    path: str
    layers: list[LayerLinears]
    lm_head: GgufLinear

    @property
    def nbytes(self) -> int:
        """The bytes a decode token reads: every linear layer's blocks and the lm_head's."""
        return self.lm_head.nbytes + sum(m.nbytes for layer in self.layers for m in layer.linears())

    def in_kernel_layout(self, dtype: torch.dtype) -> GgufWeights:
        """The same weights, each in the layout the op multiplies fastest for `dtype` here (repacked 16 rows at
        a time for bf16 on AVX-512 BF16: kernels/cpu/gguf_linear.py's kernel_layout)."""
        def relaid(m: GgufLinear) -> GgufLinear:
            return GgufLinear(*gguf_linear.kernel_layout(m.blocks, m.ggml_type, dtype), m.dense, m.bias)
        return GgufWeights(self.path, [LayerLinears(*map(relaid, layer.linears())) for layer in self.layers],
                           relaid(self.lm_head))

    def describe(self, dtype: torch.dtype = torch.float32) -> str:
        types = {m.ggml_type for layer in self.layers for m in layer.linears()}
        kinds = sorted({gguf_linear.FORMATS[t % gguf_linear.X16].name for t in types})
        repacked = " (repacked 16 rows at a time)" if types & gguf_linear.X16_FORMATS.keys() else ""
        loops = gguf_linear.paths(dtype)  # the loops the file's own layout runs on here (x16 lines have their own)
        on = f", on the {gguf_linear.LOOP_NAMES[loops[0]]} loops" if loops and not repacked else ""
        head = gguf_linear.FORMATS[self.lm_head.ggml_type % gguf_linear.X16].name
        return (f"steps of up to {BLOCKS_MAX_ROWS} rows on the GGUF's {'+'.join(kinds)} blocks{repacked}, "
                f"lm_head on its {head}{on} ({self.nbytes / 2**20:,.0f} MiB read per token, held beside the dense "
                "weights)")


def _read(path: str, header: GgufHeader, name: str, size: int) -> tuple[torch.Tensor, int]:
    """One 2-D tensor's blocks [rows, bytes per row] and its GGML type, bounded by the file's size."""
    info = header.tensors.get(name)
    if info is None:
        raise KvscopeError(f"GGUF {path!r} has no tensor {name}")
    fmt = gguf_linear.FORMATS.get(info.ggml_type)
    if fmt is None:
        kinds = ", ".join(f.name for f in gguf_linear.FORMATS.values())
        raise KvscopeError(f"--quantization gguf: {name} in {os.path.basename(path)} is GGML type {info.ggml_type}; "
                           f"kvscope multiplies {kinds} blocks (leave the flag out to dequantize)")
    if len(info.dims) != 2 or info.dims[0] % gguf_linear.BLOCK or not info.dims[1]:
        raise KvscopeError(f"GGUF {path!r}: {name} has shape {info.dims}, not [whole blocks, rows]")
    row_bytes = info.dims[0] // gguf_linear.BLOCK * fmt.nbytes
    nbytes = row_bytes * info.dims[1]
    start = header.data_offset + info.offset
    if start + nbytes > size:
        raise KvscopeError(f"GGUF {path!r}: {name}'s data runs past the end of the file")
    blocks = torch.empty(info.dims[1], row_bytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(start)
        if f.readinto(blocks.numpy()) != nbytes:
            raise KvscopeError(f"GGUF {path!r} ended while reading {name}")
    return blocks, info.ggml_type


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: GGUF row p holds the checkpoint's row perm[p], where
    perm splits each head's rows into (two halves, half-length) and interleaves them."""
    if heads <= 0 or rows % (2 * heads):
        raise KvscopeError(f"cannot undo the q/k row order: {rows} rows over {heads} heads")
    perm = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(perm)


def _cat(parts: list[tuple[torch.Tensor, int]], what: str, path: str) -> GgufLinear:
    types = {t for _, t in parts}
    if len(types) != 1:
        raise KvscopeError(f"--quantization gguf: {what} in {os.path.basename(path)} mixes block types; "
                           "leave the flag out to dequantize")
    return GgufLinear(torch.cat([b for b, _ in parts]).contiguous(), types.pop())


def read_weights(path: str, config) -> GgufWeights:
    """Every layer's linear blocks (q/k/v and gate/up fused, as cpu_linear.py fuses them) and the lm_head's."""
    header = check_servable(path)
    size = os.path.getsize(path)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    layers = []
    for i in range(config.num_hidden_layers):
        t = {}
        for name in LINEARS:
            blocks, kind = _read(path, header, f"blk.{i}.{name}.weight", size)
            if name in PERMUTED and header.architecture == "llama":
                blocks = blocks[unpermute_rows(blocks.shape[0], heads[name])]
            t[name] = (blocks, kind)
        layers.append(LayerLinears(_cat([t["attn_q"], t["attn_k"], t["attn_v"]], f"layer {i}'s q/k/v", path),
                                   GgufLinear(t["attn_output"][0], t["attn_output"][1]),
                                   _cat([t["ffn_gate"], t["ffn_up"]], f"layer {i}'s gate/up", path),
                                   GgufLinear(t["ffn_down"][0], t["ffn_down"][1])))
    head = "token_embd.weight" if header.tied_embeddings else "output.weight"
    return GgufWeights(path, layers, GgufLinear(*_read(path, header, head, size)))


def _dense(module: torch.nn.Module) -> torch.Tensor:
    return module.weight.detach()


def check_against(weights: GgufWeights, model: torch.nn.Module) -> None:
    """Layer 0's and the last layer's blocks, dequantized, must be the weights transformers loaded, bit for bit."""
    dtype = model.get_input_embeddings().weight.dtype
    body = model.model
    for i in sorted({0, len(weights.layers) - 1}):
        attn, mlp = body.layers[i].self_attn, body.layers[i].mlp
        dense = (torch.cat([_dense(attn.q_proj), _dense(attn.k_proj), _dense(attn.v_proj)]), _dense(attn.o_proj),
                 torch.cat([_dense(mlp.gate_proj), _dense(mlp.up_proj)]), _dense(mlp.down_proj))
        for what, got, want in zip(("q/k/v", "o", "gate/up", "down"), weights.layers[i].linears(), dense):
            if not torch.equal(got.dequantized(dtype), want.to(dtype)):
                raise KvscopeError(f"--quantization gguf: layer {i}'s {what} blocks in "
                                   f"{os.path.basename(weights.path)} are not the weights transformers loaded "
                                   "(an unknown row layout); leave the flag out to dequantize")
    if not torch.equal(weights.lm_head.dequantized(dtype), _dense(model.lm_head).to(dtype)):
        raise KvscopeError(f"--quantization gguf: the lm_head blocks in {os.path.basename(weights.path)} are not "
                           "the weights transformers loaded; leave the flag out to dequantize")


_last: tuple[tuple, GgufWeights] | None = None  # engines made one after another (the bench's modes) read it once


def load(path: str, model: torch.nn.Module) -> GgufWeights:
    """The blocks of the GGUF the model was loaded from, checked against the model's dense weights."""
    global _last
    key = (*file_key(path), id(model))
    if _last is not None and _last[0] == key:
        return _last[1]
    _last = None
    weights = read_weights(path, model.config)
    check_against(weights, model)
    weights = weights.in_kernel_layout(model.get_input_embeddings().weight.dtype)
    _last = (key, weights)
    return weights
