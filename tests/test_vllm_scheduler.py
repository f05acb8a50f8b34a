"""`--scheduler vllm`: vLLM's own V1 scheduler decides every step of kvscope's engine.

Greedy outputs equal transformers' `generate` (with preemption and with prefix caching), the steps
kvscope records equal those of vLLM's scheduler driven directly, and a watcher rebuilds the block
map from the events.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by `make vllm`")

from conftest import token_prompts  # noqa: E402
from kvscope.vllm.inproc.core import VllmSchedulerSettings  # noqa: E402
from kvscope.engine import LLM, SamplingParams  # noqa: E402
from kvscope.errors import KvscopeError  # noqa: E402
from kvscope.protocol import codec  # noqa: E402
from kvscope.protocol.blockmap import BlockMap  # noqa: E402
from tests.vllm_drive import Arrival, drive  # noqa: E402

MAX_TOKENS = 12
CONDITIONS = {
    # 10 blocks (one is vLLM's null block): the prompts cannot all stay, so vLLM preempts
    "preemption": (dict(block_size=16, num_blocks=10, max_num_batched_tokens=32, max_num_seqs=8), [30, 45, 20, 38, 50, 27]),
    # a shared 40-token system prompt with prefix caching on
    "prefix_caching": (dict(block_size=16, num_blocks=48, prefix_caching=True, max_num_batched_tokens=64),
                       [12, 30, 7, 25]),
}


def _prompts(condition, vocab):
    settings, lengths = CONDITIONS[condition]
    prompts = token_prompts(lengths, vocab, seed=len(lengths))
    if settings.get("prefix_caching"):
        system = token_prompts([40], vocab, seed=99)[0]
        prompts = [system + p for p in prompts]
    return settings, prompts


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_greedy_matches_transformers_under_vllm_scheduler(tiny_ref, recorder, condition):
    settings, prompts = _prompts(condition, tiny_ref.model.config.vocab_size)
    expected = tiny_ref.greedy_all(prompts, MAX_TOKENS)
    llm = LLM("tiny", sink=recorder, scheduler="vllm", device="cpu", dtype="float32", **settings)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    steps = recorder.of_type("step")
    hello = recorder.of_type("hello")[0]
    assert hello.config.scheduler == "vllm" and hello.config.vllm_version
    if condition == "preemption":
        assert any(s.preemptions for s in steps), "the pool is small enough to preempt"
    else:
        assert any(s.hits for s in steps), "the shared system prompt is found in the prefix cache"
    # a watcher folding the events holds vLLM's tables; at the end every block is back
    watcher = BlockMap(llm.engine.num_blocks)
    for s in steps:
        watcher.apply_step(codec.decode(codec.encode(s)))
    assert not any(watcher.tables.values())
    assert all(r <= 0 for r in watcher.refcount)


def test_recorded_steps_equal_vllm_driven_directly(recorder):
    """Same requests, same flags: kvscope's engine under --scheduler vllm and vLLM's scheduler alone
    schedule the same tokens per request and hold the same block tables at every step."""
    lengths = [30, 45, 20, 38, 50, 27, 9, 60]
    prompts = token_prompts(lengths, 256, seed=3)
    llm = LLM("tiny", sink=recorder, scheduler="vllm", device="cpu", dtype="float32", block_size=16, num_blocks=12,
              max_num_batched_tokens=48, max_num_seqs=4, prefix_caching=True)
    llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    settings = VllmSchedulerSettings(block_size=16, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=48,
                                     max_model_len=llm.engine.max_model_len, enable_prefix_caching=True)
    direct, _ = drive(settings, [Arrival(str(i), p, MAX_TOKENS) for i, p in enumerate(prompts)],
                      token=lambda rid, n: 1)
    steps = recorder.of_type("step")
    assert len(steps) == len(direct)
    watcher = BlockMap(12)
    for s, d in zip(steps, direct):
        assert {b.req: b.tokens for b in s.batch} == {int(r): n for r, n in d.scheduled.items()}, f"step {s.step}"
        assert sorted(p.req for p in s.preemptions) == sorted(int(r) for r in d.preempted)
        watcher.apply_step(s)
        assert {r: t for r, t in watcher.tables.items() if t} == {int(r): t for r, t in d.tables.items()}
    assert any(d.preempted for d in direct)


@pytest.mark.parametrize("flags, words", [
    (dict(mode="static"), "--mode static"),
    (dict(policy="sjf"), "sjf"),
    (dict(preemption="swap"), "swap"),
    (dict(max_num_batched_tokens=32, max_num_seqs=64), "max_num_seqs"),  # vLLM's own check, in one line
])
def test_what_vllm_does_not_do_is_refused(flags, words):
    with pytest.raises(KvscopeError, match="--scheduler vllm") as e:
        LLM("tiny", scheduler="vllm", device="cpu", dtype="float32", num_blocks=16, **flags)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_vllm_is_one_line_with_the_install_command(monkeypatch):
    from kvscope.vllm.inproc import core as vllm_core

    monkeypatch.setattr(vllm_core, "vllm_version", lambda: None)
    with pytest.raises(KvscopeError) as e:
        LLM("tiny", scheduler="vllm", device="cpu", dtype="float32", num_blocks=16)
    assert "make vllm" in str(e.value) and "vllm==0.33.0" in str(e.value) and "\n" not in str(e.value)


def test_race_plans_one_run_per_scheduler():
    from kvscope.bench.race import RaceError, plan
    from kvscope.engine.config import EngineConfig

    runs = plan(EngineConfig(), ["chunked"], [], ["kvscope", "vllm"])
    assert [(r.label, r.name, r.config.scheduler, r.config.mode) for r in runs] == [
        ("A", "kvscope", "kvscope", "chunked"), ("B", "vllm", "vllm", "chunked")]
    with pytest.raises(RaceError, match="unknown scheduler"):
        plan(EngineConfig(), ["chunked"], [], ["kvscope", "sglang"])
