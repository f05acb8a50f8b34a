"""A 16-bit copy of a GGUF file, for llama.cpp to run the weights kvscope runs (`--peers llama-cpp-bf16`).

kvscope dequantizes a quantized GGUF (transformers' loader) and computes in bf16, so beside llama.cpp on
the 4-bit file the two read different bytes per token. This copy holds the same dequantized values in
BF16 (or F16): every quantized tensor is dequantized by gguf-py, the reader transformers itself uses,
and rounded to nearest even, as torch's float32 -> bfloat16 cast is; float32 tensors (the norms) stay
float32; every metadata field is copied. llama.cpp then reads what kvscope's bf16 model reads.

The copy is made once, beside the source (`NAME.BF16.gguf`), written to a temporary name and renamed
into place; a copy older than its source is made again.
"""

from __future__ import annotations

import os
import sys

from kvscope.errors import KvscopeError

KINDS = ("bf16", "f16")


def copy_path(src: str, kind: str) -> str:
    stem = src[: -len(".gguf")] if src.endswith(".gguf") else src
    return f"{stem}.{kind.upper()}.gguf"


def sixteen_bit_copy(src: str, kind: str = "bf16") -> str:
    """The path of src's 16-bit copy, made now if it is missing or older than src."""
    if kind not in KINDS:
        raise KvscopeError(f"a 16-bit GGUF copy is bf16 or f16, not {kind!r}")
    dst = copy_path(src, kind)
    if os.path.isfile(dst) and os.path.getmtime(dst) >= os.path.getmtime(src):
        return dst
    print(f"kvscope: writing a {kind.upper()} copy of {os.path.basename(src)} for llama.cpp: {dst}", file=sys.stderr,
          flush=True)
    tmp = f"{dst}.part-{os.getpid()}"
    try:
        _write(src, tmp, kind)
        os.replace(tmp, dst)
    except OSError as e:
        raise KvscopeError(f"cannot write {dst}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def _write(src: str, dst: str, kind: str) -> None:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    qtype = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.F16
    file_type = gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16" else gguf.LlamaFileType.MOSTLY_F16
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    floats = (gguf.GGMLQuantizationType.F32,)
    for t in reader.tensors:
        if t.tensor_type in floats:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if kind == "bf16":
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, values.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def weight_bytes_per_token(path: str) -> int:
    """Bytes of weights one decode token reads from this GGUF: every tensor but the token embedding, which
    a token reads one row of, unless the output projection is tied to it (no output.weight)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    names = {t.name for t in tensors}
    tied = "output.weight" not in names
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or tied)
