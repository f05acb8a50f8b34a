"""A trace recorded under `--scheduler vllm` (sim backend) replays, exports and diagnoses, and a
consumer folding its step events with the protocol's block-map rule matches every snapshot."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by `make vllm`")

from kvscope.cli.main import main  # noqa: E402
from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.llm_engine import LLMEngine  # noqa: E402
from kvscope.protocol.blockmap import BlockMap  # noqa: E402
from kvscope.serve.driver import ServeOptions, Server  # noqa: E402
from kvscope.traces.reader import TraceReader  # noqa: E402
from kvscope.traces.writer import TraceWriter  # noqa: E402


@pytest.fixture(scope="module")
def vllm_trace(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("vllm") / "vllm.kvtrace")
    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", scheduler="vllm",
                                    num_blocks=40, max_num_seqs=16, max_num_batched_tokens=256,
                                    prefix_caching=True), snapshot_every=25)
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot, chunk_steps=32)
    engine.attach(writer)
    Server(engine, ServeOptions(workload="chat", num_requests=24, verbose_rejects=False)).run()
    engine.close()
    writer.close()
    return path


def test_block_map_rebuilt_from_events_matches_snapshots(vllm_trace):
    reader = TraceReader(vllm_trace)
    assert reader.hello.config.scheduler == "vllm"
    watcher = None
    checked = 0
    for event in reader.events():
        kind = type(event).__name__
        if kind == "SnapshotEvent":
            if watcher is None:
                watcher = BlockMap(reader.hello.config.num_blocks)
                for req, table in event.block_tables.items():
                    watcher.tables[req] = list(table)
                for owner in event.blocks:
                    watcher.owner[owner.block] = owner.req
                    watcher.refcount[owner.block] = owner.refcount
                    watcher.cached[owner.block] = int(owner.refcount == 0)
                continue
            assert {r: t for r, t in watcher.tables.items() if t} == dict(event.block_tables), f"at {event.step}"
            checked += 1
        elif kind == "StepEvent" and watcher is not None:
            watcher.apply_step(event)
    assert checked >= 2


def test_trace_exports_and_diagnoses(vllm_trace, tmp_path, capsys):
    perfetto = str(tmp_path / "p.json")
    assert main(["export", vllm_trace, "--perfetto", perfetto]) == 0
    with open(perfetto) as f:
        assert json.load(f)["traceEvents"]
    assert main(["diagnose", vllm_trace]) == 0
    assert "measure next" in capsys.readouterr().out


def test_dashboard_header_names_vllms_scheduler(vllm_trace):
    """The replayed dashboard says vLLM's scheduler decided, with its version, where kvscope shows its mode."""
    import asyncio

    from kvscope.tui.launch import make_replay_app
    from kvscope.tui.widgets.header import HeaderBar

    version = TraceReader(vllm_trace).hello.config.vllm_version

    async def run() -> str:
        app = make_replay_app(vllm_trace, playing=False)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            return str(app.screen.query_one(HeaderBar).render())

    top = asyncio.run(run()).splitlines()[0]
    assert f"vLLM {version} scheduler" in top and "chunked" not in top
    assert "kvscope engine" in top and "39×16 blocks" in top, top


def test_trace_info_names_the_engine_the_scheduler_and_vllms_version(vllm_trace):
    from kvscope.traces.info import trace_info

    version = TraceReader(vllm_trace).hello.config.vllm_version
    text = trace_info(vllm_trace)
    assert f"engine:     kvscope with vLLM {version}'s scheduler, sim backend on sim:" in text, text
    assert f"scheduler=vllm vllm_version={version}" in text and "null_block=0" in text
