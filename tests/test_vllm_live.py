"""A real vLLM, started by `kvscope serve --engine vllm`, watched from inside and from outside (`make test-vllm-live`).

One vLLM start (vLLM's CPU build from .venv-vllm, SmolLM2-135M) is shared by every check here. While it
runs: the dashboard's live feed follows the watched scheduler, `kvscope record --vllm` records /metrics and
KV events from outside, and a few requests go over the OpenAI API (the official client). Then serve is
stopped as Ctrl-C stops it, and the recordings are read back: rebuilt by the protocol's block rule,
replayed, diagnosed.

Skipped unless KVSCOPE_VLLM_LIVE=1 (`make test-vllm-live` sets it): a first start compiles for minutes
and `make test` must not wait for it, nor fail on a machine without vLLM's venv.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._helpers import free_port, wait_for

pytestmark = pytest.mark.skipif(os.environ.get("KVSCOPE_VLLM_LIVE") != "1",
                                reason="a real vLLM server: run `make test-vllm-live`")

START_S = 1200.0  # a first start on 2 busy cores: torch.compile of the model, minutes
N_COMPLETIONS = 6
# a shared prefix over one of vLLM's CPU blocks (128 tokens): stored, then hit, by every completion
SHARED = "You are a helpful assistant who answers in one short sentence. " * 14


def _ports(n: int = 4) -> int:
    from kvscope.vllm.launch.ports import port_free

    for _ in range(100):
        p = free_port()
        if p + n < 65536 and all(port_free("127.0.0.1", p + i) for i in range(n)):
            return p
    raise AssertionError("no free run of ports")


def _kvscope(*args: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvscope.cli", *args], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Start, drive and stop one real vLLM; what each check reads afterwards."""
    from kvscope.tui.feeds import LiveFeed
    from kvscope.tui.sources.live import LiveSource

    d = tmp_path_factory.mktemp("vllm-live")
    port, base = free_port(), _ports()
    events, control = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    kv, replay = f"tcp://127.0.0.1:{base + 2}", f"tcp://127.0.0.1:{base + 3}"
    url = f"http://127.0.0.1:{port}"
    inside, outside = d / "inside.kvtrace", d / "outside.kvtrace"
    serve_log = open(d / "serve.log", "wb")
    t0 = time.monotonic()
    serve = _kvscope("serve", "--engine", "vllm", "--model", "smollm2-135m", "--http", f"127.0.0.1:{port}",
                     "--events", events, "--record", str(inside), "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "512", "--", "--max-model-len", "1024", log=serve_log)
    out = {"dir": d, "url": url, "events": events, "control": control, "inside": inside, "outside": outside}
    try:
        ready = wait_for(lambda: b"vLLM ready" in (d / "serve.log").read_bytes() or serve.poll() is not None,
                         timeout=START_S, every=1.0)
        text = (d / "serve.log").read_text(errors="replace")
        assert ready and serve.poll() is None, f"vLLM did not come up:\n{text[-3000:]}"
        out["start_s"] = time.monotonic() - t0
        record = _kvscope("record", str(outside), "--vllm", url, "--kv-events", kv, "--kv-replay", replay,
                          "--interval", "0.5", log=open(d / "record.log", "wb"))
        feed = LiveFeed(LiveSource(events, control), address=events)  # what `kvscope tui` folds
        time.sleep(2.0)  # the recorder's first scrape and subscription
        out["seen"] = _drive(url, feed, out)
        feed.pump(time.monotonic())
        out["feed_state"] = feed.state
        out["control_replies"] = _control(control)
        time.sleep(1.5)  # a last scrape after the traffic
        record.send_signal(signal.SIGINT)
        out["record_code"] = record.wait(timeout=60)
        feed.close()
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)  # as Ctrl-C: vLLM's group stopped in order, the trace closed
        out["serve_code"] = serve.wait(timeout=120)
        serve_log.close()
    out["serve_log"] = (d / "serve.log").read_text(errors="replace")
    return out


def _drive(url: str, feed, out: dict) -> dict:
    """A chat and N streamed completions sharing a prefix, two at a time; the live feed folded meanwhile."""
    import threading

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    chat = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    out["chat"] = chat.choices[0].message.content
    texts: list[str] = []

    def one(i: int) -> None:
        stream = client.completions.create(model="smollm2-135m", prompt=f"{SHARED}Question {i}: name a colour.",
                                           max_tokens=24, temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in stream if c.choices))

    seen = {"max_running": 0, "steps": 0, "tables": 0}
    for pair in range(0, N_COMPLETIONS, 2):
        threads = [threading.Thread(target=one, args=(i,)) for i in (pair, pair + 1)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            feed.pump(time.monotonic())
            st = feed.state
            seen["max_running"] = max(seen["max_running"], len(st.running))
            seen["tables"] = max(seen["tables"], sum(1 for t in st.blocks.tables.values() if t))
            time.sleep(0.05)
        for t in threads:
            t.join()
        _control(out["control"])  # a snapshot with the next step: the checks compare the deltas with it
    out["completions"] = texts
    return seen


def _control(addr: str) -> dict:
    from kvscope.protocol.transport import ControlClient

    with ControlClient(addr, timeout_ms=5000) as c:
        return {"snapshot": c.request("snapshot"), "pause": c.request("pause")}


def test_vllm_answers_and_stops_cleanly_on_ctrl_c(live):
    assert "Paris" in live["chat"]
    assert len(live["completions"]) == N_COMPLETIONS and all(live["completions"])
    assert live["serve_code"] == 0, live["serve_log"][-2000:]
    assert "vLLM stopped (code 0)" in live["serve_log"]
    assert not _health(live["url"])  # nothing answers any more


def _health(url: str) -> bool:
    import http.client

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def test_the_live_feed_showed_vllms_queues_and_blocks(live):
    seen, st = live["seen"], live["feed_state"]
    assert st.config is not None and st.config.backend == "vllm-scheduler"
    assert seen["max_running"] >= 2 and seen["tables"] >= 2  # two requests at a time, each with its blocks
    assert st.steps_seen > 0 and st.ttft.n >= N_COMPLETIONS and st.itl.n > 0


def test_the_control_socket_answers_snapshot_and_refuses_the_rest(live):
    replies = live["control_replies"]
    assert replies["snapshot"]["ok"] is True
    assert replies["pause"]["ok"] is False and "HTTP API" in replies["pause"]["error"]


def test_the_inside_recording_rebuilds_by_the_block_rule_and_ends_with_bye(live):
    from kvscope.protocol.blockmap import BlockMap
    from kvscope.protocol.events import ByeEvent, RequestEvent, SnapshotEvent, StepEvent
    from kvscope.traces.reader import TraceReader

    reader = TraceReader(str(live["inside"]))
    assert reader.complete and not reader.warnings
    events = list(reader)
    assert isinstance(events[-1], ByeEvent)
    # a request that arrived before the recorder's first hello is in the snapshot that opens the trace
    known = {e.req for e in events if isinstance(e, RequestEvent)}
    known |= {r.req for e in events if isinstance(e, SnapshotEvent) for r in e.requests}
    finishes = [f.req for e in events if isinstance(e, StepEvent) for f in e.finished]
    assert len(finishes) == len(set(finishes)) == N_COMPLETIONS + 1 and set(finishes) <= known
    # a watcher that followed every step and one that joined at a later snapshot (which comes just before its
    # step, that step's changes already in it) hold the same tables once that step is applied
    def tables(m):
        return {r: list(t) for r, t in (m.tables or {}).items() if t}

    follower, joiner, checked = None, None, 0
    for ev in events:
        if isinstance(ev, SnapshotEvent):
            if follower is None:
                follower = BlockMap.from_snapshot(ev)
            else:
                joiner = BlockMap.from_snapshot(ev)
        elif isinstance(ev, StepEvent) and follower is not None:
            follower.apply_step(ev)
            if joiner is not None:
                joiner.apply_step(ev)
                assert tables(follower) == tables(joiner), f"step {ev.step}"
                checked += 1
                joiner = None
    assert follower is not None and checked >= 2  # the control socket's snapshots, between the pairs


def test_the_outside_recording_has_metrics_and_kv_events(live):
    from kvscope.traces.reader import TraceReader

    assert live["record_code"] == 0
    reader = TraceReader(str(live["outside"]))
    assert reader.vllm_recording
    kinds = [getattr(e, "type", "") for e in reader]
    assert kinds.count("vllm_metrics") >= 2 and kinds.count("vllm_kv") >= 1, set(kinds)


def test_the_recording_replays_and_is_diagnosed(live, capsys):
    import asyncio

    from kvscope.cli import main
    from kvscope.tui.launch import make_replay_app

    assert main(["trace-info", str(live["inside"])]) == 0
    assert main(["diagnose", str(live["inside"]), "--no-what-if"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck:" in out and "vllm" in out.lower()
    assert main(["report", str(live["inside"]), "--html", str(live["dir"] / "r.html")]) == 0

    async def replay():
        app = make_replay_app(str(live["inside"]), playing=False, auto_tick=False, index_in_background=False)
        async with app.run_test(size=(100, 30)) as pilot:
            last = max(e.step for e in _steps(live["inside"]))
            app.player.seek(last)
            app.pump()
            await pilot.pause()
            assert app.state.step == last

    asyncio.run(replay())


def _steps(path):
    from kvscope.protocol.events import StepEvent
    from kvscope.traces.reader import TraceReader

    return [e for e in TraceReader(str(path)) if isinstance(e, StepEvent)]
