"""The 16-bit copy of a GGUF that llama.cpp runs beside kvscope (kvscope/bench/gguf16.py): the dequantized
values rounded as torch rounds them, every metadata field kept, made once, and the bytes a token reads."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvscope.bench.gguf16 import copy_path, sixteen_bit_copy, weight_bytes_per_token
from kvscope.errors import KvscopeError


def write_source(path, tied: bool) -> str:
    import gguf

    rng = np.random.default_rng(4)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    embed = rng.standard_normal((64, 32)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(rng.standard_normal((96, 32)).astype(np.float32),
                                                             gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if not tied:
        w.add_tensor("output.weight", rng.standard_normal((64, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_the_bf16_copy_holds_the_dequantized_values_rounded_as_torch_rounds_them(tmp_path):
    import gguf

    src = write_source(tmp_path / "m.Q8_0.gguf", tied=False)
    dst = sixteen_bit_copy(src, "bf16")
    assert dst == str(tmp_path / "m.Q8_0.BF16.gguf") == copy_path(src, "bf16")
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert after.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_BF16
    assert after.fields["general.name"].contents() == "tiny test"
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert after.fields["llama.block_count"].contents() == 1
    types = {t.name: t.tensor_type.name for t in after.tensors}
    assert types == {"token_embd.weight": "BF16", "blk.0.attn_norm.weight": "F32", "blk.0.ffn_up.weight": "BF16",
                     "output.weight": "BF16"}
    for t in before.tensors:
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            want = want.to(torch.bfloat16)  # what kvscope's loader computes with
        (got,) = [u for u in after.tensors if u.name == t.name]
        values = torch.from_numpy(gguf.quants.dequantize(got.data, got.tensor_type).astype(np.float32))
        assert torch.equal(values, want.float()), t.name


def test_the_copy_is_made_once_and_again_when_the_source_is_newer(tmp_path, capsys):
    src = write_source(tmp_path / "m.gguf", tied=True)
    dst = sixteen_bit_copy(src, "f16")
    assert "writing a F16 copy" in capsys.readouterr().err
    made = os.path.getmtime(dst)
    assert sixteen_bit_copy(src, "f16") == dst and os.path.getmtime(dst) == made
    assert capsys.readouterr().err == "", "reused without a word"
    os.utime(src, (made + 10, made + 10))
    sixteen_bit_copy(src, "f16")
    assert "writing a F16 copy" in capsys.readouterr().err
    assert not [n for n in os.listdir(tmp_path) if ".part" in n]


def test_a_token_reads_every_weight_but_the_embedding_unless_the_output_is_tied(tmp_path):
    import gguf

    untied = write_source(tmp_path / "u.gguf", tied=False)
    tied = write_source(tmp_path / "t.gguf", tied=True)
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(untied).tensors}
    assert weight_bytes_per_token(untied) == sum(sizes.values()) - sizes["token_embd.weight"]
    assert weight_bytes_per_token(tied) == sum(sizes.values()) - sizes["output.weight"]


def test_another_kind_is_refused(tmp_path):
    with pytest.raises(KvscopeError, match="bf16 or f16"):
        sixteen_bit_copy(write_source(tmp_path / "m.gguf", tied=True), "q8")
