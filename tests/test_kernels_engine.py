"""The engine on the Triton kernels, on CPU through Triton's interpreter.

- Greedy outputs with the Triton ops swapped in equal transformers' generate
  (chunked prefill under a small budget: extend chunks, mixed steps, decodes).
- The CUDA-graph path's static buffers: a decode-only step copied into them,
  padded to a captured size, gives the eager forward's logits.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from conftest import token_prompts  # noqa: E402
from kvscope.engine import LLM, SamplingParams  # noqa: E402
from kvscope.engine.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from kvscope.kernels import AttentionOps  # noqa: E402
from kvscope.kernels.triton import attention as triton_attention  # noqa: E402

TRITON_OPS = AttentionOps("triton", triton_attention.write_kv, triton_attention.paged_attention)


def triton_llm(**settings) -> LLM:
    llm = LLM("tiny", device="cpu", dtype="float32", **settings)
    llm.engine.runner.ops = TRITON_OPS
    return llm


def test_greedy_on_triton_kernels_matches_transformers(tiny_ref):
    prompts = token_prompts([5, 21, 37], 256, seed=7)
    llm = triton_llm(mode="chunked", num_blocks=24, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == tiny_ref.greedy_all(prompts, 6)


@pytest.mark.parametrize("name", ["mistral-w24", "qwen3-hybrid-w20"])
def test_windowed_checkpoints_on_triton_kernels_match_transformers(windowed_models, name):
    """Sliding windows through the Triton decode and prefill kernels: chunks straddle the window edge,
    decodes cross it, and (Mistral) blocks outside it are freed and never read."""
    path, ref = windowed_models[name]
    prompts = token_prompts([30, 19], 300, seed=4)
    llm = LLM(path, device="cpu", dtype="float32", mode="chunked", num_blocks=16, max_num_batched_tokens=16)
    llm.engine.runner.ops = TRITON_OPS
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref.greedy_all(prompts, 8)


def test_selection_triton_on_cuda_the_paged_kernel_on_cpu_references_elsewhere(monkeypatch):
    from kvscope.kernels import reference, select_attention_ops
    from kvscope.kernels.cpu import library as cpu_attention

    assert select_attention_ops("cpu").paged_attention is cpu_attention.paged_attention
    assert select_attention_ops("mps").paged_attention is reference.paged_attention
    cuda = select_attention_ops("cuda")
    assert cuda.name == "triton" and cuda.write_kv is triton_attention.write_kv
    assert LLM("tiny", device="cpu", dtype="float32", num_blocks=8).engine.runner.ops.name == "cpu-paged"
    monkeypatch.setenv("KVSCOPE_CPU_ATTENTION", "reference")
    assert LLM("tiny", device="cpu", dtype="float32", num_blocks=8).engine.runner.ops.name == "torch-reference"


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(300)[-3:] == [256, 288, 300]


def test_decode_graph_buffers_give_the_eager_logits():
    llm = triton_llm(mode="chunked", num_blocks=24, max_num_batched_tokens=64)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner, max_batch=4, max_model_len=llm.engine.max_model_len)
    eager_forward = runner._forward
    checked = []

    def both(out):
        eager = eager_forward(out)
        if graphs.can_run(out):
            b = graphs.prepare(out)
            static = graphs.forward_static(b)[: len(out.seqs)]
            torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
            checked.append((len(out.seqs), b))
        return eager

    runner._forward = both
    prompts = token_prompts([3, 18, 9], 256, seed=9)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 4)]
    llm.generate(prompts, params)
    # three running (padded to 4), then two, then one: every padding case seen
    assert {(3, 4), (2, 2), (1, 1)} <= set(checked), checked


@pytest.mark.parametrize("bad", [{"enforce_eager": "yes"}, {"gpu_memory_utilization": 0.0},
                                 {"gpu_memory_utilization": 1.5}])
def test_gpu_settings_are_validated(bad):
    from kvscope.engine.config import EngineConfig
    from kvscope.errors import KvscopeError

    with pytest.raises(KvscopeError):
        EngineConfig(**bad).validate()


def test_kv_budget_arithmetic_with_a_real_dummy_forward(monkeypatch):
    """cuda_kv_budget on CPU with torch.cuda's memory queries faked: the runner's worst-case step really runs."""
    from kvscope.engine.worker import kv_sizing
    from kvscope.engine.worker.model_runner import ModelRunner
    from kvscope.engine.loader.models import load_model

    gib = 1 << 30
    calls = []
    fake = dict(synchronize=lambda *a: None, empty_cache=lambda: None, memory_allocated=lambda *a: 3 * gib,
                reset_peak_memory_stats=lambda *a: calls.append("reset"),
                max_memory_allocated=lambda *a: 5 * gib, mem_get_info=lambda *a: (70 * gib, 80 * gib))
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    loaded = load_model("tiny", torch.float32, "cpu")
    steps = []

    def make_runner(num_blocks):
        runner = ModelRunner(loaded, device=torch.device("cpu"), dtype=torch.float32, num_blocks=num_blocks,
                             block_size=16)
        run = runner.run
        runner.run = lambda out, params: steps.append(out) or run(out, params)
        return runner

    budget = kv_sizing.cuda_kv_budget(
        make_runner, torch.device("cpu"), max_len=loaded.max_position_embeddings, block_size=16,
        max_num_batched_tokens=24, max_num_seqs=4, gpu_memory_utilization=0.9, cuda_graphs=True).bytes
    # 0.9 x 80 GiB - 10 GiB resident - 2 GiB activation peak - the graph pool reserve
    assert budget == int(80 * gib * 0.9) - 10 * gib - 2 * gib - kv_sizing.GRAPH_MEMORY_RESERVE
    assert calls == ["reset"]
    # the profiled step is the worst the scheduler can build: the whole token budget, max_num_seqs sampling
    (step,) = steps
    assert step.num_tokens == 24 and len(step.seqs) == 4 and all(s.sample for s in step.seqs)
    eager = kv_sizing.cuda_kv_budget(
        make_runner, torch.device("cpu"), max_len=loaded.max_position_embeddings, block_size=16,
        max_num_batched_tokens=24, max_num_seqs=4, gpu_memory_utilization=0.1, cuda_graphs=False).bytes
    assert eager == 0  # less than nothing left: clamped
