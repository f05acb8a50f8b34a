"""The vectorized step inputs equal the per-token loop they replace, tensor for tensor."""

from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine.worker.inputs import InputBuilder
from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput

NUM_BLOCKS = 64


def random_step(rng: random.Random, block_size: int, pad: bool) -> SchedulerOutput:
    out = SchedulerOutput(step=1, budget=10_000)
    for req in range(rng.randint(1, 12)):
        start = rng.choice([0, rng.randint(0, 300)])
        n = rng.choice([1, 1, rng.randint(1, 200)])
        blocks = -(-(start + n) // block_size) + rng.randint(0, 2)  # a table may run past the tokens
        table = [rng.randrange(NUM_BLOCKS) for _ in range(blocks)]
        if n == 1 and rng.random() < 0.5 and not out.other_seqs:
            d = out.decodes  # the scheduler's decode columns, filled as it fills them
            d.req_ids.append(req), d.positions.append(start), d.token_ids.append(rng.randrange(1000))
            d.block_tables.append(table)
        else:
            out.add(ScheduledSeq(req, [rng.randrange(1000) for _ in range(n)], start, table,
                                 sample=rng.random() < 0.7, is_prefill=n > 1))
    if pad:
        out.pad_rows.extend(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
    return out


def assert_same(a, b) -> None:
    for name in ("input_ids", "position_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    assert a.meta.query_lens_host == b.meta.query_lens_host
    assert a.meta.seq_lens_host == b.meta.seq_lens_host
    assert a.meta.block_size == b.meta.block_size
    assert a.sample_rows == b.sample_rows


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("pad", [False, True])
def test_vectorized_inputs_equal_the_per_token_loop(block_size, pad):
    rng = random.Random(f"inputs/{block_size}/{pad}")
    builder = InputBuilder(block_size, NUM_BLOCKS, num_scratch_blocks=40 if pad else 0, device=torch.device("cpu"))
    for _ in range(25):
        out = random_step(rng, block_size, pad)
        assert_same(builder.build(out), builder.build_reference(out))


def test_padding_rows_alone_use_the_scratch_blocks():
    builder = InputBuilder(4, NUM_BLOCKS, num_scratch_blocks=3, device=torch.device("cpu"))
    out = SchedulerOutput(step=1, budget=64, pad_rows=[6, 2])
    got = builder.build(out)
    assert_same(got, builder.build_reference(out))
    assert got.meta.slot_mapping.tolist() == [256, 257, 258, 259, 260, 261, 256, 257]
    assert got.meta.block_tables.tolist() == [[64, 65], [64, 0]]
    assert got.sample_rows == []


def test_kept_block_tables_equal_the_tables_across_steps_of_growth_replacement_and_turnover():
    """BlockTableRows against a fresh copy of every table, over many steps: tables that grow in
    place, tables replaced by new lists (freed and taken again, shorter or longer), requests that
    leave and arrive (rows reused), and a table wider than the array."""
    from kvscope.engine.worker.inputs import BlockTableRows

    rng = random.Random("kept-rows")
    rows = BlockTableRows(rows=4, width=4)
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        for req_id in list(live):
            r = rng.random()
            if r < 0.08:
                del live[req_id]  # finished: its row is freed when rows run short
            elif r < 0.14:
                live[req_id] = [rng.randrange(500) for _ in range(rng.randint(1, 30))]  # dropped, taken again
            elif r < 0.6:
                live[req_id].extend(rng.randrange(500) for _ in range(rng.randint(0, 3)))  # grew in place
        while len(live) < rng.randint(1, 24):
            live[next_id] = [rng.randrange(500) for _ in range(rng.choice([1, 5, 70]))]
            next_id += 1
        ids = rng.sample(sorted(live), rng.randint(1, len(live)))  # a step schedules some of them
        tables = [live[i] for i in ids]
        assert rows.gather(ids, tables).tolist() == InputBuilder._pack(tables).tolist()


def test_engine_steps_build_the_same_inputs_with_kept_tables_under_preemption_forks_and_prefix_hits():
    """The real scheduler's outputs (recompute preemption, parallel samples that copy their last
    prompt block, prefix-cache hits) give the per-token loop's inputs at every step."""
    from kvscope.engine import LLMEngine, SamplingParams
    from kvscope.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", num_blocks=24, block_size=4, max_num_seqs=8,
                                    max_num_batched_tokens=64, prefix_caching=True))
    builder = InputBuilder(4, 25, 0, torch.device("cpu"))
    seen = {"steps": 0, "kept": 0}
    run = engine.runner.run

    def checked(out, params):
        seen["steps"] += 1
        seen["kept"] += out.tables_grow_in_place and len(out.decodes) > 0
        assert_same(builder.build(out), builder.build_reference(out))
        return run(out, params)

    engine.runner.run = checked
    rng = random.Random(3)
    shared = [rng.randrange(200) for _ in range(9)]
    for i in range(10):
        prompt = shared + [rng.randrange(200) for _ in range(rng.randint(1, 14))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(4, 30), ignore_eos=True,
                                                  n=2 if i % 3 == 0 else 1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.num_preemptions > 0, "the cache is small enough to preempt"
    assert seen["kept"] > seen["steps"] // 2
