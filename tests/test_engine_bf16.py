"""bfloat16: greedy tokens equal transformers' in bf16, except at near-ties (the rule is in _bf16.py).

The float32 tests (test_engine_equality.py and the rest) stay token-exact and ask for float32.
"""

from __future__ import annotations

import pytest

from _bf16 import check_within_near_ties
from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.engine.cpu.dtype import auto_cpu_dtype

MAX_TOKENS = 24
PROMPT_LENGTHS = [5, 17, 33, 48, 70, 12]


def _bf16_reference(model_name: str, model_arg: str):
    import torch
    from transformers import AutoModelForCausalLM

    from kvscope.engine.loader.models import build_builtin

    if model_name == "tiny":
        return build_builtin("tiny", dtype=torch.bfloat16, device="cpu").eval()
    return AutoModelForCausalLM.from_pretrained(model_arg, dtype=torch.bfloat16, local_files_only=True).eval()


@pytest.mark.parametrize("mode", ["chunked"])
@pytest.mark.parametrize("model_name", ["tiny", "llama"])
def test_bf16_greedy_matches_transformers_up_to_near_ties(models, model_name, mode):
    model_arg, _, vocab = models[model_name]
    ref = _bf16_reference(model_name, model_arg)
    prompts = token_prompts(PROMPT_LENGTHS, vocab, seed=29)
    # a 24-token budget splits the longer prompts into chunks, a packing transformers never sees
    llm = LLM(model_arg, mode=mode, device="cpu", dtype="bfloat16", num_blocks=64, max_num_batched_tokens=24)
    assert llm.engine.dtype == "bfloat16"
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))

    at_top = check_within_near_ties(ref, prompts, outs, MAX_TOKENS)
    # most tokens are the reference's own choice: the near-tie allowance is for rounding, not a different model
    assert at_top >= 0.9 * MAX_TOKENS * len(prompts), f"only {at_top} tokens were transformers' top"


def test_bf16_sampling_runs_in_float32():
    """Sampled (temperature) requests work from bf16 logits, reproducibly for a fixed seed."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=5, ignore_eos=True)
    runs = [LLM("tiny", device="cpu", dtype="bfloat16", num_blocks=32).generate([[3, 4, 5, 6]], params)[0].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_auto_dtype_follows_cpu_flags():
    assert auto_cpu_dtype(frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})).name == "bfloat16"
    assert auto_cpu_dtype(frozenset({"avx2", "avx512f", "avx512_bf16"})).name == "bfloat16"
    plain = auto_cpu_dtype(frozenset({"avx2", "avx512f"}))
    assert plain.name == "float32" and "neither" in plain.reason
    assert "amx_bf16" in auto_cpu_dtype(frozenset({"amx_bf16"})).reason


def test_auto_dtype_is_said_at_start_up():
    llm = LLM("tiny", device="cpu", num_blocks=16)
    line = llm.engine.describe_dtype()
    assert line.startswith(f"dtype {auto_cpu_dtype().name} on cpu (auto: ")
    assert llm.engine.hello().config.dtype == auto_cpu_dtype().name


def test_bf16_kv_blocks_swap_out_copy_and_back_bit_for_bit():
    import torch

    from kvscope.engine.worker.swapper import KvSwapper

    cache = torch.randn(2, 2, 8, 4, 2, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    before = cache.clone()
    swapper = KvSwapper(cache, num_cpu_blocks=3)
    assert swapper.cpu_cache.dtype == torch.bfloat16
    swapper.apply(swap_out=[(2, 0), (5, 1)], copies=[(1, 6)], swap_in=[])
    cache[:, :, [2, 5]] = 0
    swapper.apply(swap_out=[], copies=[], swap_in=[(0, 3), (1, 7)])
    assert torch.equal(cache[:, :, 3], before[:, :, 2]) and torch.equal(cache[:, :, 7], before[:, :, 5])
    assert torch.equal(cache[:, :, 6], before[:, :, 1])


def test_bf16_preemption_by_swap_finishes_every_request():
    """A tight bf16 cache: requests are swapped out and back, and each still gets all its tokens."""
    llm = LLM("tiny", device="cpu", dtype="bfloat16", mode="chunked", num_blocks=10, preemption="swap",
              swap_space=0.01, max_num_batched_tokens=32)
    prompts = token_prompts([30, 45, 20, 38, 50, 27], 256, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(o.error is None and len(o.token_ids) == 16 for o in outs)
    assert llm.engine.num_preemptions > 0


def test_near_tie_bar_is_bf16_resolution_at_the_logit():
    """A gap of a few bf16 roundings is a near-tie whatever the logit's size; a real gap is not."""
    from _bf16 import NEAR_TIE, near_tie

    assert near_tie(3.0) == NEAR_TIE  # small logits: the fixed bar
    assert near_tie(23.625) == 0.5 and near_tie(-23.625) == 0.5  # ulp 0.125 at 16-32: 3 ulps (0.375) is a tie
    assert near_tie(40.0) == 1.0  # ulp 0.25 at 32-64
    assert 0.375 < near_tie(23.625) < 1.0 and near_tie(0.0) == NEAR_TIE
