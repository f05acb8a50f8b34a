"""GGUF checkpoints (llama.cpp / Ollama files), loaded through transformers' own GGUF loader.

Before the slow load, the file's header is read here (bounded, no code run) to refuse
what kvscope cannot serve in one line: another architecture, or a tensor type that
transformers cannot dequantize. transformers then dequantizes every tensor to the
engine's dtype; the quantized form is not kept.

Parsing a GGUF (its 49k-entry vocabulary above all) is slow in transformers, so the
last file loaded stays in memory: engines made one after another in one process (tests,
the bench's modes) load it once.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvscope.errors import KvscopeError
from kvscope.engine.loader.hf_quiet import transformers_bars_off

if TYPE_CHECKING:  # the header reader runs without torch (the sim catalog reads a GGUF's shape)
    import torch

GGUF_MAGIC = b"GGUF"
# GGUF's general.architecture values kvscope serves (Mistral files say "llama")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
# bounds on what a header may claim, so a hostile file cannot make us allocate or loop without end
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY = 1 << 24
MAX_STRING = 1 << 24
MAX_DIMS = 8
MAX_NESTING = 8  # arrays of arrays: GGUF writers nest one level at most; a deeper file is hostile
MAX_ITEMS = 1 << 24  # array entries visited one by one over the whole header (nested ones and strings)
MAX_TENSOR_NAME = 1024  # ggml's own limit is 64 bytes
MAX_TENSOR_ELEMENTS = 1 << 40  # a dimension product past this is no real tensor
# the largest value a shape field may take (what a hostile header could make the loader allocate or loop over);
# each comfortably above every published model's
SHAPE_LIMITS = {"num_hidden_layers": 1 << 12, "hidden_size": 1 << 18, "intermediate_size": 1 << 20,
                "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
                "max_position_embeddings": 1 << 24, "vocab_size": 1 << 22}
# the tensors every layer of a llama / qwen2 / qwen3 GGUF holds ("blk.N.<name>")
LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# GGUF value types: fixed sizes; 8 is a string, 9 an array
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INT_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
# "{architecture}.KEY" fields that give the model's shape (GGUF's names), and the transformers
# config field each one is
SHAPE_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
              "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
              "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
              "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}
TOKENS_KEY = "tokenizer.ggml.tokens"  # its length is the vocabulary where no vocab_size key is written


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's data lies in the file, as its header says (gguf_blocks.py checks it against the file)."""

    dims: tuple[int, ...]  # ggml's order: dims[0] is the contiguous one (a linear layer's in_features)
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufHeader:
    architecture: str
    name: str
    tensor_types: frozenset[int]  # GGML type ids of the tensors
    shape: dict[str, int] = field(default_factory=dict)  # transformers config names -> the header's values
    tied_embeddings: bool = False  # no output.weight tensor: the lm_head is the token embedding
    tensor_names: tuple[str, ...] = ()
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0  # where the data section starts: after the header, aligned to general.alignment

    def quant_names(self) -> list[str]:
        return sorted(_type_name(t) for t in self.tensor_types)


def is_gguf_path(model: str) -> bool:
    return model.lower().endswith(".gguf")


class _Reader:
    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.items_left = MAX_ITEMS  # a budget over the whole header: nested arrays cannot multiply the work

    def spend(self, count: int) -> None:
        self.items_left -= count
        if self.items_left < 0:
            raise KvscopeError(f"{self.path}: the header's arrays hold over {MAX_ITEMS} entries in all")

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise KvscopeError(f"{self.path} is not a complete GGUF file (it ends inside its header)")
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self, limit: int = MAX_STRING) -> str:
        n = self.u64()
        if n > limit:
            raise KvscopeError(f"{self.path}: a header string claims {n} bytes")
        return self.take(n).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Past an array of strings (a vocabulary: ~100k of them), without decoding any; a tight loop."""
        read, seek, unpack = self.f.read, self.f.seek, struct.unpack
        self.spend(count)
        for _ in range(count):
            raw = read(8)
            if len(raw) != 8:
                raise KvscopeError(f"{self.path} is not a complete GGUF file (it ends inside its header)")
            n = unpack("<Q", raw)[0]
            if n > MAX_STRING:
                raise KvscopeError(f"{self.path}: a header string claims {n} bytes")
            seek(n, os.SEEK_CUR)

    def value(self, kind: int, keep: bool, depth: int = 0):
        if kind == 8:
            return self.string()
        if kind == 9:
            if depth >= MAX_NESTING:
                raise KvscopeError(f"{self.path}: header arrays nested over {MAX_NESTING} deep")
            item, count = self.u32(), self.u64()
            if count > MAX_ARRAY:
                raise KvscopeError(f"{self.path}: a header array claims {count} entries")
            if item in _SCALAR_SIZES:
                self.f.seek(count * _SCALAR_SIZES[item], os.SEEK_CUR)
            elif item == 8:
                self.skip_strings(count)
            else:
                self.spend(count)
                for _ in range(count):
                    self.value(item, keep=False, depth=depth + 1)
            return ("array", count) if keep else None
        if kind not in _SCALAR_SIZES:
            raise KvscopeError(f"{self.path}: unknown GGUF value type {kind}")
        if not keep:
            self.f.seek(_SCALAR_SIZES[kind], os.SEEK_CUR)
            return None
        data = self.take(_SCALAR_SIZES[kind])
        return struct.unpack(_INT_FORMATS[kind], data)[0] if kind in _INT_FORMATS else data


def read_header(path: str) -> GgufHeader:
    """The architecture, name, tensor types and shape of a GGUF file, read from its header only."""
    try:
        with open(path, "rb") as f:
            r = _Reader(f, path)
            if f.read(4) != GGUF_MAGIC:
                raise KvscopeError(f"{path} is not a GGUF file (no GGUF magic at its start)")
            version = r.u32()
            if version not in (2, 3):
                raise KvscopeError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            n_tensors, n_kv = r.u64(), r.u64()
            if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
                raise KvscopeError(f"{path}: header claims {n_tensors} tensors and {n_kv} keys")
            fields: dict[str, str] = {}
            ints: dict[str, int] = {}  # "{architecture}.KEY" shape fields, of whichever architecture
            tokens = None
            alignment = 32  # GGUF's default
            for _ in range(n_kv):
                key = r.string()
                kind = r.u32()
                shape_key = key.split(".", 1)[-1] in SHAPE_KEYS
                value = r.value(kind, keep=shape_key or key in ("general.architecture", "general.name", TOKENS_KEY,
                                                               "general.alignment"))
                if isinstance(value, str):
                    fields[key] = value
                elif shape_key and isinstance(value, int):  # a per-layer array is no one shape: left out
                    ints[key] = value
                elif key == TOKENS_KEY and isinstance(value, tuple):
                    tokens = value[1]
                elif key == "general.alignment" and isinstance(value, int):
                    alignment = value
            arch = fields.get("general.architecture", "")
            shape = {SHAPE_KEYS[k.split(".", 1)[1]]: v for k, v in ints.items() if k.startswith(f"{arch}.")}
            if "vocab_size" not in shape and tokens is not None:
                shape["vocab_size"] = tokens
            types = set()
            names = []
            tensors = {}
            for _ in range(n_tensors):
                names.append(r.string(MAX_TENSOR_NAME))
                dims = r.u32()
                if dims > MAX_DIMS:
                    raise KvscopeError(f"{path}: a tensor claims {dims} dimensions")
                extent = tuple(r.u64() for _ in range(dims))
                numel = 1
                for n in extent:
                    numel *= n
                if numel > MAX_TENSOR_ELEMENTS:
                    raise KvscopeError(f"{path}: tensor {names[-1][:64]!r} claims {numel} elements")
                ggml_type = r.u32()
                types.add(ggml_type)
                tensors[names[-1]] = TensorInfo(extent, ggml_type, r.u64())
            if not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
                raise KvscopeError(f"{path}: general.alignment {alignment} is not a power of two up to 65536")
            data_offset = -(-f.tell() // alignment) * alignment
    except OSError as e:
        raise KvscopeError(f"cannot read {path}: {e.strerror or e}") from None
    for key, value in shape.items():
        if not 1 <= value <= SHAPE_LIMITS[key]:
            gguf_key = next(k for k, v in SHAPE_KEYS.items() if v == key)
            raise KvscopeError(f"{path}: header field {arch}.{gguf_key} = {value} is outside 1..{SHAPE_LIMITS[key]}")
    if "head_dim" not in shape and shape.get("num_attention_heads") and "hidden_size" in shape:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]  # transformers' default too
    return GgufHeader(fields.get("general.architecture", ""), fields.get("general.name", ""), frozenset(types),
                      shape, tied_embeddings="output.weight" not in names, tensor_names=tuple(names), tensors=tensors,
                      data_offset=data_offset)


def check_layers(path: str, header: GgufHeader) -> None:
    """Refuse a file whose tensors do not cover the layers its header declares: transformers would fill each
    missing weight with random values and serve the result without a word."""
    layers = header.shape.get("num_hidden_layers")
    if layers is None:
        raise KvscopeError(f"GGUF {path!r} declares no {header.architecture}.block_count")
    present: dict[int, set[str]] = {}
    for name in header.tensor_names:
        block, _, rest = name.partition(".")[2].partition(".") if name.startswith("blk.") else ("", "", "")
        if block.isdigit():
            present.setdefault(int(block), set()).add(rest)
    missing = [f"blk.{i}.{t}" for i in range(layers) for t in LAYER_TENSORS if t not in present.get(i, ())]
    extra = sorted(i for i in present if i >= layers)
    if "token_embd.weight" not in header.tensor_names:
        missing.insert(0, "token_embd.weight")
    if missing:
        held = sum(1 for i in range(layers) if i in present)
        raise KvscopeError(f"GGUF {path!r} declares {layers} layers but its tensors hold {held} of them whole "
                           f"(missing {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); "
                           "transformers would fill the rest with random weights")
    if extra:
        raise KvscopeError(f"GGUF {path!r} declares {layers} layers but holds tensors of layer {extra[0]}")


def _dequantizable() -> dict[int, str]:
    """GGML type id -> name for every type the installed gguf package can turn into floats."""
    try:
        import gguf
        from gguf import quants
    except ImportError:
        raise KvscopeError("loading a GGUF file needs the 'gguf' package (pip install gguf)") from None
    names = dict(FLOAT_TYPES)
    # gguf-py registers one dequantizer class per quantized type in this table
    for qtype in getattr(quants, "_type_traits", {}):
        names[int(qtype)] = gguf.GGMLQuantizationType(qtype).name
    return names


def _type_name(type_id: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type {type_id}"


_servable: tuple[tuple, GgufHeader] | None = None  # the last file found servable, by its identity on disk


def file_key(path: str) -> tuple:
    """A file's identity on disk (where it is, its inode, size and modification time): the key under which
    this module's and gguf_blocks.py's per-process memos keep what they read from it. Raises OSError."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_servable(path: str) -> GgufHeader:
    """Refuse, in one line naming it, a GGUF that kvscope cannot serve; before any weight is read.
    A start reads the same file's header for the model and again for its blocks: the second is the first's,
    while the file is the same one, unchanged (its inode, size and modification time)."""
    global _servable
    try:
        key = file_key(path)
    except OSError:
        key = None  # read_header says why, in one line
    if key is not None and _servable is not None and _servable[0] == key:
        return _servable[1]
    header = _check_servable(path)
    _servable = (key, header) if key is not None else None
    return header


def _check_servable(path: str) -> GgufHeader:
    header = read_header(path)
    if header.architecture not in GGUF_ARCHITECTURES:
        raise KvscopeError(f"GGUF {path!r} holds architecture {header.architecture or 'unnamed'!r}; kvscope serves "
                           f"llama, qwen2, qwen3 and mistral")
    known = _dequantizable()
    bad = sorted(_type_name(t) for t in header.tensor_types if t not in known)
    if bad:
        raise KvscopeError(f"GGUF {path!r} uses quantization type {bad[0]}, which transformers cannot dequantize")
    check_layers(path, header)
    return header


_last: tuple[tuple, tuple] | None = None  # (key, (model, tokenizer)) of the last file loaded


def _dequantize_kwargs() -> dict:
    """Ask transformers to dequantize every weight at load. Its newer GGUF loader would otherwise keep the
    blocks packed for matmul kernels it fetches from a hub (the `kernels` package; kvscope fetches nothing
    at run time, and computes in float), and without that package warns, for any dtype but float32, that
    the packed weights cast every matmul, and then dequantizes after all."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: dequantizing is all its GGUF loader does
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_gguf(path: str, dtype: torch.dtype, device: str):
    """(model, transformers tokenizer or None, header) from a GGUF file; nothing is fetched from a hub."""
    global _last
    header = check_servable(path)
    key = (*file_key(path), dtype, str(device))
    if _last is not None and _last[0] == key:
        return (*_last[1], header)
    _last = None  # let the previous model go before the next one is built
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    folder, name = os.path.split(os.path.abspath(path))
    # transformers draws its own de-quantizing bar with tqdm directly (its progress-bar switch does not
    # reach it); kvscope's loading line already says what is happening, so the bar is off meanwhile
    bar = hf_gguf.tqdm
    hf_gguf.tqdm = functools.partial(bar, disable=True)
    try:
        with transformers_bars_off():
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True,
                                                         **_dequantize_kwargs())
    except Exception as e:  # a corrupt tensor or an unknown layout surface as several exception types
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise KvscopeError(f"cannot load GGUF {path!r}: {first_line}") from None
    finally:
        hf_gguf.tqdm = bar
    model = model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception:  # a GGUF without tokenizer metadata takes token-id prompts only
        tokenizer = None
    _last = (key, (model, tokenizer))
    return model, tokenizer, header


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers take (tied weights counted once), and the weights of linear
    layers already packed for oneDNN (cpu_linear.py: a model a first engine packed, from the loader's cache)."""
    import torch

    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    for m in model.modules():
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor):  # opaque: no data_ptr, but its size is the weight's
            total += packed.numel() * packed.element_size()
    return total
