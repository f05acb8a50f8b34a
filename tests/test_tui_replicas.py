"""`kvscope tui --replicas N`: a data-parallel deployment's ranks side by side, and the imbalance between them."""

from __future__ import annotations

import pytest

from kvscope.tui.feeds import EngineRow
from kvscope.tui.screens.replicas import imbalance
from tests.fakes.streams import ChunkedSource, drained_sim_stream


def _row(running, waiting) -> EngineRow:
    return EngineRow(name="r", kind="kvscope", setup="", connection="live", running=running, waiting=waiting,
                     kv_used=0.1, tok_per_s=1.0, ttft_p99_s=None, itl_p99_s=None, preemptions=0)


def test_a_rank_that_queues_while_another_has_room_is_uneven():
    v = imbalance([_row(8, 12), _row(3, 0)], [8, 8])
    assert v.uneven and (v.busiest, v.idlest) == (0, 1)
    assert v.text == "uneven: rank 0 queues 12 (100% of all waiting) while rank 1 has room (3/8 running, none waiting)"


def test_queues_everywhere_or_no_queue_is_balanced():
    assert not imbalance([_row(8, 5), _row(8, 4)], [8, 8]).uneven  # both full and queueing: no room to move to
    assert not imbalance([_row(4, 0), _row(1, 0)], [8, 8]).uneven  # nobody waits
    assert not imbalance([_row(8, 1), _row(0, 0)], [8, 8]).uneven  # one waiting request is no queue
    assert imbalance([_row(8, 5), _row(8, 0)], [8, 8]).uneven is False  # the idle rank is full too
    assert imbalance([_row(3, 1)], [8]) is None  # one rank: nothing to compare
    assert imbalance([_row(3, 1), _row(None, None)], [8, 8]) is None  # the other has not reported yet


@pytest.fixture(scope="module")
def ranks():
    busy = drained_sim_stream(0, requests=30, max_num_seqs=2)  # everything at once on two seats: a long queue
    idle = drained_sim_stream(1, requests=3, max_num_seqs=8)
    return busy, idle


@pytest.mark.anyio
async def test_each_rank_has_its_column_and_block_map_and_the_strip_names_the_imbalance(ranks):
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import LiveFeed
    from kvscope.tui.screens.replicas import ImbalanceStrip, ReplicaColumn, ReplicaDashboard
    from kvscope.tui.widgets import BlockMap

    feeds = [LiveFeed(ChunkedSource(events, per_poll=per_poll), name=f"tcp://127.0.0.1:{5557 + i}")
             for i, (events, per_poll) in enumerate(zip(ranks, (12, 4)))]
    app = KvscopeApp(feeds, first="replicas", auto_tick=False)
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(3):
            app.pump()
            await pilot.pause()
        busy, idle = (f.state for f in feeds)
        assert len(busy.waiting) >= 2 and not idle.waiting and idle.running
        columns = app.screen.query(ReplicaColumn)
        assert len(columns) == 2
        for i, col in enumerate(columns):
            block_map = col.query_one(BlockMap)
            assert block_map.state is feeds[i].state  # each column draws its own rank's blocks
            owned = {b for t in feeds[i].state.blocks.tables.values() for b in t}
            assert owned, "a rank with running requests holds blocks"
        strip = str(app.screen.query_one(ImbalanceStrip).render())
        assert f"uneven: rank 0 queues {len(busy.waiting)}" in strip and "while rank 1 has room" in strip
        await pilot.press("tab", "enter")
        await pilot.pause()
        assert isinstance(app.screen, ReplicaDashboard) and app.screen.feed is feeds[1]
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen.query(ReplicaColumn)


@pytest.mark.parametrize("args,word", [
    (["--replicas", "2", "--connect", "tcp://127.0.0.1:5557", "--connect", "tcp://127.0.0.1:5600"], "one --connect"),
    (["--replicas", "2", "--vllm", "http://127.0.0.1:8000"], "one --connect"),
    (["--replicas", "0"], "outside"), (["--replicas", "2", "--connect", "ipc:///tmp/x"], "tcp://HOST:PORT")])
def test_bad_replica_flags_are_one_line(args, word, capsys):
    from kvscope.cli import main

    assert main(["tui", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0]
