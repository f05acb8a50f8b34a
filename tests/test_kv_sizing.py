"""KV cache sizing on CPU: kv_cache_space, the default from available memory, and what hello reports."""

from __future__ import annotations

import pytest

from kvscope.engine.kv import budget as kv_budget
from kvscope.engine.worker import kv_sizing
from kvscope.errors import KvscopeError
from kvscope.engine.errors import RequestRejected

GiB = 1 << 30
# tiny: 4 layers x K,V x 16 tokens x 2 KV heads x dim 32 x fp32. The engines here pin float32: --dtype auto
# is bfloat16 on a CPU with amx_bf16 or avx512_bf16, which would halve the bytes.
TINY_BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4


def test_default_is_a_share_of_available_memory_within_the_caps():
    cap = kv_budget.CPU_KV_CACHE_CAP_BYTES
    share = kv_budget.cpu_kv_budget(None, need_bytes=100 * GiB, available=6 * GiB)
    assert share.bytes == int(6 * GiB * kv_budget.CPU_KV_CACHE_FRACTION) and "6.0 GiB available" in share.how
    capped = kv_budget.cpu_kv_budget(None, need_bytes=100 * GiB, available=64 * GiB)
    assert capped.bytes == cap and "capped" in capped.how
    needed = kv_budget.cpu_kv_budget(None, need_bytes=GiB // 8, available=64 * GiB)
    assert needed.bytes == GiB // 8, "never more than max_num_seqs x max_model_len can use"


def test_explicit_space_is_taken_as_given_or_refused_in_one_line():
    assert kv_budget.cpu_kv_budget(1.5, need_bytes=GiB, available=8 * GiB).bytes == int(1.5 * GiB)
    with pytest.raises(KvscopeError) as e:
        kv_budget.cpu_kv_budget(12, need_bytes=GiB, available=8 * GiB)
    assert str(e.value) == "kv_cache_space 12 GiB does not fit: 8.0 GiB of memory is available"


def test_a_budget_below_one_block_is_an_error():
    with pytest.raises(KvscopeError, match="holds no block"):
        kv_budget.num_blocks_for(kv_budget.KvBudget(1000, "kv_cache_space 1e-06 GiB"), 4096)


def test_engine_sizes_from_faked_memory_and_hello_carries_the_size(monkeypatch):
    from kvscope.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 64 << 20)  # 64 MiB "available"
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", max_num_seqs=4))
    assert engine.num_blocks == (32 << 20) // TINY_BLOCK_BYTES  # half of it
    hello = engine.hello().config
    assert hello.kv_cache_bytes == engine.num_blocks * TINY_BLOCK_BYTES == engine.kv_cache_bytes
    assert hello.cpu.kv_cache_space is None
    assert "50% of 0.1 GiB available" in engine.describe_kv_cache()

    sized = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", kv_cache_space=0.01))
    assert sized.num_blocks == int(0.01 * GiB) // TINY_BLOCK_BYTES
    assert sized.hello().config.cpu.kv_cache_space == 0.01


def test_a_request_that_can_never_fit_is_rejected_in_one_line():
    from kvscope.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", kv_cache_space=3 * TINY_BLOCK_BYTES / GiB))
    assert engine.num_blocks == 3
    with pytest.raises(RequestRejected) as e:
        engine.add_request(list(range(1, 100)), SamplingParams(max_tokens=4))
    assert "does not fit in the KV cache (48 tokens)" in str(e.value) and "\n" not in str(e.value)


def test_cli_kv_cache_space_that_does_not_fit_is_one_line(monkeypatch, capsys):
    from kvscope.cli import main

    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: 2 * GiB)
    assert main(["serve", "--device", "cpu", "--kv-cache-space", "3", "--num-requests", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == "kvscope: error: kv_cache_space 3 GiB does not fit: 2.0 GiB of memory is available\n"


@pytest.mark.parametrize("bad", [0, -1, "4", True])
def test_kv_cache_space_is_validated(bad):
    from kvscope.engine.config import EngineConfig

    with pytest.raises(KvscopeError, match="kv_cache_space"):
        EngineConfig(kv_cache_space=bad).validate()


def test_the_chosen_size_survives_the_wire():
    from kvscope.engine import EngineConfig, LLMEngine
    from kvscope.protocol.codec import decode, encode

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", kv_cache_space=0.01))
    back = decode(encode(engine.hello()))
    assert back.config.kv_cache_bytes == engine.kv_cache_bytes and back.config.cpu.kv_cache_space == 0.01


def test_the_cpu_pool_is_zero_and_writable():
    import torch

    t = kv_sizing.zeroed_cpu_tensor((2, 3, 4), torch.float32)
    assert t.shape == (2, 3, 4) and torch.count_nonzero(t) == 0
    t[1, 2, 3] = 5.0
    assert t.sum().item() == 5.0
