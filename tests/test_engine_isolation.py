"""One failing request ends alone (finish reason "error"); the rest of its batch finishes token-exact,
and the engine keeps stepping. Hostile sampling values reach no failure at all."""

from __future__ import annotations

import pytest

from conftest import token_prompts
from kvscope.engine import LLM, SamplingParams
from kvscope.protocol.events import FINISH_ERROR
from tests.fakes.faults import FaultySampler, fail_forward_for

N = 6
LENGTHS = [5, 19, 11, 26, 8, 14]
SETTINGS = dict(device="cpu", num_blocks=64, max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def prompts():
    return token_prompts(LENGTHS, 256, seed=5)


def greedy(n=N):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def without_it(prompts):
    """The batch as it runs with no failing request in it."""
    outs = LLM("tiny", **SETTINGS).generate(prompts, greedy())
    return [o.token_ids for o in outs]


def _check(outs, without_it, bad: int):
    assert outs[bad].finish_reason == FINISH_ERROR and "injected" in outs[bad].error
    rest = [o for i, o in enumerate(outs) if i != bad]
    assert [o.token_ids for o in rest] == without_it
    assert all(o.finish_reason == "length" and o.error is None for o in rest)


@pytest.mark.parametrize("mode", ["chunked", "static"])
def test_a_sampler_fault_ends_one_request_and_the_batch_finishes_token_exact(prompts, without_it, mode):
    llm = LLM("tiny", mode=mode, **SETTINGS)
    bad = 3
    # request ids follow submission order: the faulty one is the fourth (sampled, so it reaches the fault)
    llm.engine.runner.sampler = FaultySampler(0, {bad})
    batch = prompts[:bad] + [[7, 8, 9]] + prompts[bad:]
    params = [greedy()] * bad + [SamplingParams(max_tokens=N, temperature=1.0)] + [greedy()] * (N - bad)
    outs = llm.generate(batch, params)
    _check(outs, without_it, bad)
    assert outs[bad].token_ids == []  # it failed on its first token
    # the engine goes on stepping: a later request is served normally
    again = llm.generate(prompts[0], greedy())
    assert again[0].token_ids == without_it[0]


def test_a_forward_fault_is_pinned_on_its_request_by_running_the_step_in_halves(prompts, without_it):
    llm = LLM("tiny", **SETTINGS)
    bad = 2
    sizes = fail_forward_for(llm.engine.runner, {bad})
    batch = prompts[:bad] + [[40, 41, 42, 43]] + prompts[bad:]
    outs = llm.generate(batch, [greedy()] * (N + 1))
    _check(outs, without_it, bad)
    assert "the model step failed" in outs[bad].error
    assert max(sizes) == N + 1 and 1 in sizes  # the full step failed, then it was found alone
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free == llm.engine.num_blocks


def test_a_forward_fault_while_decoding_is_pinned_on_its_request(prompts, without_it):
    """The fault comes once the failing request decodes, in a step of decodes and prefills."""
    llm = LLM("tiny", **SETTINGS)
    bad = 2
    runner = llm.engine.runner
    forward = runner._forward
    decoding_steps = []

    def faulty(out):
        if any(s.req_id == bad and not s.is_prefill for s in out.seqs):
            decoding_steps.append(out.num_seqs)
            raise RuntimeError("injected forward fault")
        return forward(out)

    runner._forward = faulty
    batch = prompts[:bad] + [[40, 41, 42, 43]] + prompts[bad:]
    outs = llm.generate(batch, [greedy()] * (N + 1))
    _check(outs, without_it, bad)
    assert outs[bad].token_ids and len(outs[bad].token_ids) < N  # it had sampled, then failed while decoding
    assert max(decoding_steps) > 1  # the fault hit a step shared with others, which went on
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free == llm.engine.num_blocks


@pytest.mark.parametrize("temperature, top_p", [(1e-40, 1.0), (5e-324, 1.0), (1.0, 1e-46), (1e-40, 1e-46)])
def test_hostile_sampling_values_are_handled_where_they_enter(prompts, without_it, temperature, top_p):
    """A temperature under the floor is greedy; a top_p that rounds to 0 keeps the top token."""
    llm = LLM("tiny", **SETTINGS)
    odd = SamplingParams(max_tokens=N, temperature=temperature, top_p=top_p, ignore_eos=True, seed=3)
    outs = llm.generate(prompts + [prompts[0]], [greedy()] * N + [odd])
    assert [o.token_ids for o in outs[:N]] == without_it
    assert outs[N].finish_reason == "length" and len(outs[N].token_ids) == N
    if temperature < 1e-5 or top_p < 1e-40:
        assert outs[N].token_ids == without_it[0]  # greedy either way: one token is left to draw
