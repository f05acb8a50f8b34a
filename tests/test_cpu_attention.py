"""The CPU kernel that reads the KV pages in place (kvscope.kernels.cpu.library) against the torch reference.

Decode rows go through the C++ op, prefill chunks through the reference's SDPA; either way every
query must get what reference.paged_attention gives it (fp32 to rounding, bf16 to bf16's
precision), blocks wholly before a sliding window must never be read, and where the kernel
cannot be had the engine must still start, on the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvscope.kernels import reference, select_attention_ops, testing
from kvscope.kernels.cpu import library as cpu_attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Compiled once per machine (cached); a build failure here is a test failure, not a skip."""
    if cpu_attention.load() is None:
        pytest.fail("the CPU attention kernel did not build on this machine (see the note on stderr)")


def check(query_lens, seq_lens, *, heads, kv_heads, head_dim, block_size=16, dtype=torch.float32, window=None,
          poison=False, seed=0):
    query, k_cache, v_cache, meta = testing.make_case(query_lens, seq_lens, heads=heads, kv_heads=kv_heads,
                                                      head_dim=head_dim, block_size=block_size, dtype=dtype,
                                                      seed=seed)
    scale = head_dim ** -0.5
    # The reference runs on the caches as they were: it reads padded table entries (masked), so a NaN
    # block there would be its NaN, not the kernel's. What the window hides cannot change the answer.
    want = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    if poison:
        testing.poison_outside_window(k_cache, v_cache, meta, window)
        assert torch.isnan(k_cache).any()
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, scale, window)
    assert got.dtype == query.dtype and got.shape == query.shape
    assert torch.isfinite(got).all(), "a block outside the window (NaN-filled) was read"
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # bf16: the output's own rounding (8 bits of mantissa)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    return got


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (4, 4, 32),  # MHA
    (4, 2, 32), (8, 2, 64), (8, 1, 64),  # group sizes 2, 4, 8
    (16, 8, 128),  # Qwen3-0.6B
    (9, 3, 64),  # SmolLM2-135M
])
def test_decode_batches_of_mixed_lengths(heads, kv_heads, head_dim, dtype):
    """Contexts of 1 token, of whole blocks, and ending part-way into a block; block tables shuffled."""
    check([1] * 7, [1, 16, 17, 31, 48, 100, 257], heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, dtype):
    check([1, 1, 1], [5, 64, 70], heads=8, kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 30])
def test_one_sequence_or_many_share_the_threads(num_seqs):
    """Few sequences split their KV heads across work items; many take all heads each."""
    lens = [40 + 23 * i for i in range(num_seqs)]
    check([1] * num_seqs, lens, heads=16, kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=num_seqs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 20, 64])
def test_sliding_window_never_reads_blocks_before_it(window, dtype):
    """Blocks wholly before each query's window point at one NaN block, as freed blocks do."""
    check([1, 1, 1, 1], [3, 16, 45, 130], heads=8, kv_heads=2, head_dim=64, dtype=dtype, window=window, poison=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_chunks_beside_decodes(window, dtype):
    """Chunks (query_len > 1) stay on the reference's SDPA; decodes around them on the kernel."""
    check([1, 20, 1, 7, 1], [33, 20, 90, 50, 1], heads=9, kv_heads=3, head_dim=64, dtype=dtype, window=window,
          poison=window is not None)


def test_prefill_only_step():
    check([12, 5], [12, 40], heads=4, kv_heads=2, head_dim=32)


def test_a_bf16_cache_under_float32_queries():
    query, k_cache, v_cache, meta = testing.make_case([1, 1], [30, 70], heads=4, kv_heads=2, head_dim=32,
                                                      block_size=16, dtype=torch.bfloat16)
    query = query.float()
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.2)
    want = reference.paged_attention(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_a_strided_query_as_transformers_passes_it():
    """The engine hands over query[0].transpose(0, 1) of a [1, H, T, D] tensor: not contiguous."""
    query, k_cache, v_cache, meta = testing.make_case([1, 1, 1], [9, 30, 65], heads=8, kv_heads=4, head_dim=32,
                                                      block_size=16, dtype=torch.float32)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    got = cpu_attention.paged_attention(strided, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(got, reference.paged_attention(query, k_cache, v_cache, meta, 0.3))


def test_float16_goes_to_the_reference():
    query, k_cache, v_cache, meta = testing.make_case([1, 3], [20, 10], heads=4, kv_heads=2, head_dim=32,
                                                      block_size=16, dtype=torch.float16)
    got = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.2)
    assert torch.equal(got, reference.paged_attention(query, k_cache, v_cache, meta, 0.2))


def test_cpu_engines_get_the_kernel_unless_told_otherwise(monkeypatch):
    assert select_attention_ops("cpu").name == "cpu-paged"
    monkeypatch.setenv(cpu_attention.CHOICE_ENV, "reference")
    ops = select_attention_ops("cpu")
    assert ops.name == "torch-reference" and ops.paged_attention is reference.paged_attention


def test_a_failed_build_leaves_a_note_and_the_reference(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu_attention, "_loaded", None)
    monkeypatch.setattr(cpu_attention, "_failed", None)
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path))  # no cached build here

    def no_compiler(folder, flags):
        raise RuntimeError("Error building extension 'kvscope_cpu_attention'\nc++: error: not found")

    monkeypatch.setattr(cpu_attention, "_compile", no_compiler)
    ops = select_attention_ops("cpu")
    assert ops.name == "torch-reference"
    err = capsys.readouterr().err
    assert "did not build" in err and "using the torch reference" in err
    assert [ln for ln in err.splitlines() if "did not build" in ln] == [
        "kvscope: the CPU attention kernel did not build (Error building extension 'kvscope_cpu_attention'); "
        "using the torch reference attention"]
    assert select_attention_ops("cpu").name == "torch-reference"
    assert "did not build" not in capsys.readouterr().err, "noted once, not tried again in this process"


def test_the_build_cache_lives_outside_the_repo_and_follows_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_attention.CACHE_ENV, str(tmp_path))
    first, second = cpu_attention.BASE_FLAG_SETS[:2]
    folder = cpu_attention.build_dir(first)
    assert folder.startswith(str(tmp_path / "extensions" / "cpu_attention-"))
    assert folder != cpu_attention.build_dir(second), "flags are part of the key"
    monkeypatch.delenv(cpu_attention.CACHE_ENV)
    assert not cpu_attention.build_dir(first).startswith(REPO)


def test_a_cached_build_loads_without_the_extension_builder():
    """Start-up: importing the kernels and loading a cached build must not import torch.utils.cpp_extension."""
    code = ("import sys; from kvscope.kernels import select_attention_ops; "
            "assert 'torch.utils.cpp_extension' not in sys.modules; "
            "name = select_attention_ops('cpu').name; "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'loaded through the builder'; print(name)")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop(cpu_attention.CHOICE_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu-paged" and "compiling" not in done.stderr
