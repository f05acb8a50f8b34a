"""Linear layers over GGUF blocks (kernels/cpu/gguf_linear.py, csrc/cpu_gguf.cpp; engine/loader/gguf_blocks.py).

The weights a block widens to are gguf-py's dequantized values (what transformers loads), rounded
to the activations' dtype, bit for bit; the product is a dense GEMM's up to summation order; the
real file's blocks, in kvscope's row order, are the weights transformers loaded from it.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError
from kvscope.kernels.cpu import library as cpu_attention
from kvscope.kernels.cpu import gguf_linear

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    cpu_attention.load()


def random_blocks(out: int, in_features: int, ggml_type: int, seed: int = 0) -> torch.Tensor:
    """Blocks of random quants with finite f16 scales of a realistic size (and negative ones)."""
    rng = np.random.default_rng(seed)
    fmt = gguf_linear.FORMATS[ggml_type]
    b = rng.integers(0, 256, size=(out, in_features // 32, fmt.nbytes), dtype=np.uint8)
    scales = (rng.standard_normal((out, in_features // 32, 2)) * 0.02).astype(np.float16)
    b[..., 0:2] = scales[..., 0:1].view(np.uint8)
    if ggml_type == 3:
        b[..., 2:4] = scales[..., 1:2].view(np.uint8)
    return torch.from_numpy(b.reshape(out, -1).copy())


def gguf_py(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """gguf-py's own dequantizer: the values transformers' GGUF loader builds a model from."""
    import gguf
    from gguf import quants

    values = quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(blocks.shape[0], -1)


def _op_loaded() -> bool:
    return gguf_linear.op_available()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widened_weights_are_gguf_py_values_rounded_once(name, dtype):
    blocks = random_blocks(48, 96, TYPES[name])
    want = gguf_py(blocks, TYPES[name]).to(dtype)

    def bits(t: torch.Tensor) -> torch.Tensor:  # -0.0 and +0.0 told apart
        return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    assert torch.equal(bits(gguf_linear.dequantize_reference(blocks, TYPES[name], dtype)), bits(want))
    if _op_loaded():
        assert torch.equal(bits(torch.ops.kvscope.gguf_dequantize(blocks, TYPES[name], dtype)), bits(want))


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17, 33])  # one tile, tiles (of 4 or 8) and a remainder, dense
def test_linear_is_a_dense_gemm_up_to_summation_order(name, dtype, rows):
    """Every loop this CPU runs (AVX-512, AVX2 on any CPU with it, generic), not only the default one."""
    if not _op_loaded():
        pytest.skip("the CPU kernels did not build here")
    ggml_type = TYPES[name]
    blocks = random_blocks(40, 160, ggml_type, seed=rows)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = torch.randn(2, rows, 160, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = gguf_py(blocks, ggml_type).to(dtype)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())  # exact products, then one rounding
    # float32: summation order; bf16: the output's one rounding (2^-8 relative) on top
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    ref = gguf_linear.linear_reference(x, blocks, ggml_type, bias)
    paths = gguf_linear.paths(dtype)
    assert "generic" in paths
    for path in ["", *paths]:
        got = torch.ops.kvscope.gguf_linear_on(x, blocks, ggml_type, bias, path)
        assert got.dtype == dtype and got.shape == (2, rows, 40)
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item()), path
        assert torch.allclose(got.double(), ref.double(), rtol=2 * tol, atol=2 * tol * want.abs().max().item()), path
    assert torch.equal(torch.ops.kvscope.gguf_linear(x, blocks, ggml_type, bias),
                       torch.ops.kvscope.gguf_linear_on(x, blocks, ggml_type, bias, paths[0]))


def test_the_default_loops_are_the_widest_this_cpu_runs_under_its_cap():
    """AVX-512 where the CPU (under ONEDNN_MAX_CPU_ISA) has it, else AVX2 + FMA + F16C, else generic; the AVX2 loops
    are there to test on every CPU with AVX2, capped or not."""
    if not _op_loaded():
        pytest.skip("the CPU kernels did not build here")
    from kvscope import cpu_isa

    flags = cpu_isa.cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    with open(os.path.join(os.path.dirname(cpu_attention.load()), "built-ok")) as f:
        if "-march=native" not in f.read():  # the generic fallback build keeps its generic loops first
            pytest.skip("the CPU kernels were built here without -march=native")
    avx2 = {"avx2", "fma", "f16c"} <= cpu_isa.read_cpu_flags()
    assert ("avx2" in gguf_linear.paths(torch.float32)) == avx2
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "generic"
    assert gguf_linear.paths(torch.float32)[0] == want
    bf16 = "avx512-bf16" if {"avx512_bf16", "avx512bw"} <= flags else "avx2" if want != "generic" else "generic"
    assert gguf_linear.paths(torch.bfloat16)[0] == bf16
    with pytest.raises(RuntimeError, match="no 'avx9' loops"):
        torch.ops.kvscope.gguf_linear_on(torch.zeros(1, 64), random_blocks(8, 64, 3), 3, None, "avx9")


X16_TYPES = TYPES


def _x16_here() -> bool:
    return _op_loaded() and torch.ops.kvscope.gguf_x16()


@pytest.mark.parametrize("name", list(X16_TYPES))
def test_x16_lines_hold_the_same_weights_as_the_blocks(name):
    """pack_x16 reorders bytes only: unpacking gives the blocks back, and the C++ op widens the lines to the
    very values it widens the file's blocks to, bit for bit, in both dtypes."""
    ggml_type = X16_TYPES[name]
    blocks = random_blocks(48, 160, ggml_type, seed=3)
    lines = gguf_linear.pack_x16(blocks, ggml_type)
    x16 = gguf_linear.X16 + ggml_type
    assert lines.shape == (3, 16 * blocks.shape[1])
    assert torch.equal(gguf_linear.unpack_x16(lines, x16), blocks)
    assert (gguf_linear.in_features(lines, x16), gguf_linear.out_features(lines, x16)) == (160, 48)
    for dtype in (torch.float32, torch.bfloat16):
        want = gguf_linear.dequantize_reference(blocks, ggml_type, dtype)
        assert torch.equal(gguf_linear.dequantize_reference(lines, x16, dtype), want)
        if _op_loaded():
            got = torch.ops.kvscope.gguf_dequantize(lines, x16, dtype)
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("name", list(X16_TYPES))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 33])  # row tiles of 4, a remainder, the dense path
def test_x16_linear_multiplies_the_files_exact_weights(name, rows):
    """On x16 lines the op multiplies the unrounded weights (d q + m in float32) into float32: its bf16
    output is the exact product rounded once, but for the summation's last bits at a rounding boundary."""
    if not _x16_here():
        pytest.skip("the x16 kernel needs AVX-512 BF16")
    ggml_type = X16_TYPES[name]
    blocks = random_blocks(64, 192, ggml_type, seed=rows)
    lines = gguf_linear.pack_x16(blocks, ggml_type)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.double(), gguf_py(blocks, ggml_type).double(), bias.double())
    got = torch.ops.kvscope.gguf_linear(x, lines, gguf_linear.X16 + ggml_type, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 64)
    if rows > 32:  # the dense path: the weights rounded to bf16 first, as a dequantized model holds them
        assert torch.allclose(got.double(), exact, rtol=8e-3, atol=8e-3 * exact.abs().max().item())
        return
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(2.0 ** -10)  # one bf16 step at each value
    assert ((got.double() - exact).abs() <= 0.5 * ulp + 1e-5 * exact.abs().max()).all()
    assert (got == exact.to(torch.bfloat16)).float().mean().item() >= 0.98


def test_kernel_layout_packs_only_what_the_x16_kernel_multiplies():
    blocks = random_blocks(48, 64, 3)
    if _x16_here():
        lines, kind = gguf_linear.kernel_layout(blocks, 3, torch.bfloat16)
        assert kind == gguf_linear.X16 + 3 and torch.equal(gguf_linear.unpack_x16(lines, kind), blocks)
        assert gguf_linear.format_of(kind).name == "Q4_1x16"
    for b, t, dtype in ((blocks, 3, torch.float32), (random_blocks(48, 64, 8), 8, torch.float32),
                        (random_blocks(40, 64, 3), 3, torch.bfloat16)):  # float32, rows not whole lines
        same, kind = gguf_linear.kernel_layout(b, t, dtype)
        assert same is b and kind == t


def test_the_op_refuses_bad_shapes_in_one_line():
    if not _op_loaded():
        pytest.skip("the CPU kernels did not build here")
    blocks = random_blocks(8, 64, 3)
    with pytest.raises(RuntimeError, match="last dimension is 32, the weight's 64"):
        torch.ops.kvscope.gguf_linear(torch.zeros(1, 32), blocks, 3, None)
    with pytest.raises(RuntimeError, match="unsupported GGML type 12"):
        torch.ops.kvscope.gguf_linear(torch.zeros(1, 64), blocks, 12, None)
    with pytest.raises(RuntimeError, match="not whole blocks"):
        torch.ops.kvscope.gguf_linear(torch.zeros(1, 64), blocks[:, :30].contiguous(), 3, None)


def test_unpermute_rows_undoes_llama_cpp_q_k_order():
    from kvscope.engine.loader.gguf_blocks import unpermute_rows

    heads, rows = 3, 24
    checkpoint = torch.arange(rows)
    # llama.cpp's converter: each head's rows split in two halves, then interleaved
    in_file = checkpoint.reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    assert torch.equal(in_file[unpermute_rows(rows, heads)], checkpoint)
    with pytest.raises(KvscopeError, match="cannot undo"):
        unpermute_rows(25, heads)


def test_the_real_files_blocks_are_the_weights_transformers_loaded(smollm2_path):
    """Every layer, in kvscope's row order (q/k un-permuted, q/k/v and gate/up fused), bit for bit."""
    from kvscope.engine.loader.gguf import load_gguf
    from kvscope.engine.loader.gguf_blocks import read_weights

    model, _, _ = load_gguf(smollm2_path, torch.float32, "cpu")
    weights = read_weights(smollm2_path, model.config)
    assert {m.ggml_type for layer in weights.layers for m in layer.linears()} == {3}
    assert weights.lm_head.ggml_type == 8 and weights.lm_head.out_features == model.config.vocab_size
    for i, layer in enumerate(weights.layers):
        block = model.model.layers[i]
        attn, mlp = block.self_attn, block.mlp
        dense = [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                 torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
        for ours, want in zip(layer.linears(), dense):
            assert torch.equal(gguf_linear.dequantize_reference(ours.blocks, ours.ggml_type, torch.float32),
                               want.detach()), f"layer {i}"
    # 97 MB: what llama.cpp reads per token from the same file (the bench's weights/token column)
    assert 90e6 < weights.nbytes < 100e6


def test_a_truncated_file_is_refused_in_one_line(smollm2_path, tmp_path):
    from kvscope.engine.loader.gguf import load_gguf
    from kvscope.engine.loader.gguf_blocks import read_weights

    model, _, _ = load_gguf(smollm2_path, torch.float32, "cpu")
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.truncate(os.path.getsize(smollm2_path) - 4096)
    with pytest.raises(KvscopeError, match="runs past the end of the file"):
        read_weights(str(cut), model.config)


def test_quantization_is_checked_in_one_line():
    with pytest.raises(KvscopeError, match=r"unknown quantization 'awq' \(choose from auto, gguf, none\)"):
        EngineConfig(quantization="awq").validate()
    with pytest.raises(KvscopeError, match="the sim backend runs no weights"):
        EngineConfig(model="llama-3.3-70b-fp8", backend="sim", quantization="gguf").validate()
    EngineConfig(model="llama-3.3-70b-fp8", backend="sim").validate()  # auto, the default, asks nothing of the sim
    from kvscope.engine import LLM

    with pytest.raises(KvscopeError, match="needs a GGUF model"):
        LLM("tiny", device="cpu", quantization="gguf")


def test_many_rows_go_to_the_dense_weight_beside_the_blocks():
    """A few rows (a chat stream's decode) read the blocks; a prefill chunk or a large batch is arithmetic-bound
    and runs on the model's dense weight of the same layer."""
    from kvscope.engine.loader.gguf_blocks import BLOCKS_MAX_ROWS, GgufLinear

    blocks = random_blocks(16, 64, 3)
    calls = []

    class Dense(torch.nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            return torch.nn.functional.linear(x, gguf_py(blocks, 3).to(x.dtype))

    layer = GgufLinear(blocks, 3).beside(Dense())
    few = torch.randn(BLOCKS_MAX_ROWS, 64)
    many = torch.randn(BLOCKS_MAX_ROWS + 1, 64)
    assert torch.allclose(layer(few), Dense()(few), atol=1e-4) and calls == [BLOCKS_MAX_ROWS]
    layer(many)
    assert calls == [BLOCKS_MAX_ROWS, BLOCKS_MAX_ROWS + 1]
    assert GgufLinear(blocks, 3)(many).shape == (BLOCKS_MAX_ROWS + 1, 16)  # no dense beside: the blocks


def test_the_hello_says_the_blocks_ran_and_the_header_shows_it(smollm2_path, tmp_path):
    """A recorded or live run says which weights ran: hello.config.quantization "gguf", absent when dequantized."""
    import asyncio

    from kvscope.engine import LLM
    from kvscope.protocol.codec import decode, encode
    from kvscope.traces.writer import TraceWriter
    from kvscope.tui.launch import make_replay_app
    from kvscope.tui.widgets.header import HeaderBar

    engine = LLM(smollm2_path, device="cpu", dtype="float32", num_blocks=8, quantization="gguf").engine
    config = decode(encode(engine.hello())).config
    assert config.quantization == "gguf" and config.dtype == "float32"
    dense = LLM(smollm2_path, device="cpu", dtype="float32", num_blocks=8, quantization="none").engine.hello()
    assert "quantization" not in dense.config.as_dict() and decode(encode(dense)).config.quantization != "gguf"

    path = str(tmp_path / "blocks.kvtrace")
    TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot).close()

    async def header() -> str:
        app = make_replay_app(path, playing=False)
        async with app.run_test(size=(140, 30)) as pilot:
            await pilot.pause()
            return str(app.screen.query_one(HeaderBar).render())

    assert "cpu · GGUF blocks" in asyncio.run(header()).splitlines()[0]


def test_the_blocks_take_the_models_bias_for_their_weight():
    """Qwen2's q/k/v carry biases (F32 tensors beside the blocks, loaded by transformers): the blocks' layer adds the
    model's own, fused in the blocks' row order, with zeros for a part that has none."""
    from kvscope.engine.loader.gguf_blocks import GgufLinear

    blocks = random_blocks(24, 64, 3)
    q, k, v = (torch.nn.Linear(64, n, bias=b) for n, b in ((8, True), (8, False), (8, True)))
    layer = GgufLinear(blocks, 3).beside((q, k, v))
    assert layer.dense is None  # separate modules: no one dense weight to hand large inputs to
    assert torch.equal(layer.bias, torch.cat([q.bias, torch.zeros(8), v.bias]))
    x = torch.randn(3, 64)
    want = torch.nn.functional.linear(x, gguf_py(blocks, 3), layer.bias)
    assert torch.allclose(layer(x), want, atol=1e-4)
    assert GgufLinear(blocks, 3).beside(torch.nn.Linear(64, 24, bias=False)).bias is None


def test_hostile_headers_are_refused_in_one_line(tmp_path):
    """What --quantization gguf newly reads from a GGUF (the data section's alignment, each tensor's type, shape and
    offset) is checked before a byte of data is read."""
    from types import SimpleNamespace

    import gguf

    from kvscope.engine.loader.gguf import read_header
    from kvscope.engine.loader.gguf_blocks import read_weights
    from test_hostile_inputs import _llama_gguf

    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    float_linears = _llama_gguf(tmp_path / "f32.gguf", 1, 1)  # a servable file whose linear layers are F32
    with pytest.raises(KvscopeError, match=r"blk\.0\.attn_q\.weight .* is GGML type 0; kvscope multiplies Q4_0"):
        read_weights(float_linears, config)

    w = gguf.GGUFWriter(str(tmp_path / "align.gguf"), "llama")
    w.add_uint32("general.alignment", 3)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(KvscopeError, match="general.alignment 3 is not a power of two"):
        read_header(str(tmp_path / "align.gguf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_takes_the_blocks_only_where_they_are_the_same_weights_and_faster(dtype):
    """--quantization auto: a GGUF on a CPU, in float32, where the blocks have AVX2 or AVX-512 loops; explicit flags
    are kept whatever the CPU; the reason is the start-up line's."""
    from kvscope.engine.worker.model_backend import choose_quantization

    assert choose_quantization("gguf", False, "m.gguf", torch.bfloat16) == ("gguf", "as asked")
    for asked in ("none", None):
        assert choose_quantization(asked, False, "m.gguf", torch.float32) == (None, "")
    assert choose_quantization("auto", True, "m.gguf", torch.float32) == (None, "")  # CUDA
    assert choose_quantization("auto", False, "", torch.float32) == (None, "")  # not a GGUF: nothing to say
    chosen, why = choose_quantization("auto", False, "m.gguf", dtype)
    loops = gguf_linear.paths(torch.float32)
    if dtype == torch.bfloat16:
        assert chosen is None and why.startswith("auto: dequantized into bfloat16")
    elif loops and loops[0] != "generic":
        assert chosen == "gguf" and why == f"auto: float32 on this CPU's {gguf_linear.LOOP_NAMES[loops[0]]} loops, " \
                                          "the same weights"
    else:
        assert chosen is None and "generic C++" in why


def test_auto_falls_back_to_the_dense_weights_where_the_blocks_cannot_run(smollm2_path, monkeypatch):
    """Where kvscope's decoder is off (transformers' forward), auto dequantizes and says why; gguf refuses."""
    from kvscope.engine import LLM
    from kvscope.engine.cpu.decoder import FORCE_ENV

    monkeypatch.setenv(FORCE_ENV, "transformers")
    engine = LLM(smollm2_path, device="cpu", dtype="float32", num_blocks=8).engine
    assert engine.backend.quantization is None and engine.backend.gguf_weights is None
    assert "quantization" not in engine.hello().config.as_dict()
    if gguf_linear.paths(torch.float32)[:1] not in ([], ["generic"]):
        assert "GGUF dequantized (auto: dequantized, since kvscope's decoder is off here" in engine.describe_model()
    with pytest.raises(KvscopeError, match="runs through kvscope's CPU decoder, which is off here"):
        LLM(smollm2_path, device="cpu", dtype="float32", num_blocks=8, quantization="gguf")
