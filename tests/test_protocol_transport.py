"""ZeroMQ transport: publisher never blocks, late/stalled subscribers, control channel.

Only loopback addresses, and ports chosen by the OS.
"""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
from _helpers import DEADLINE_S, wait_for

zmq = pytest.importorskip("zmq")

from fakes.streams import SimRun  # noqa: E402

from kvscope.protocol import ByeEvent, FanOut, StepEvent, encode  # noqa: E402
from kvscope.protocol.transport import (  # noqa: E402
    DEFAULT_CONTROL_ADDR,
    DEFAULT_EVENTS_ADDR,
    ControlClient,
    ControlServer,
    Subscriber,
    ZmqPublisher,
    check_bind_address,
)
from kvscope.protocol.blockmap import BlockMap  # noqa: E402

ANY = "tcp://127.0.0.1:0"
REPLY_MS = int(DEADLINE_S * 1000)  # a control reply on a loaded machine: the deadline bounds a hang only


def _until(cond, timeout=DEADLINE_S, every=0.005):
    return wait_for(cond, timeout, every)


# ----------------------------------------------------------------------------- addresses


def test_defaults_are_loopback():
    check_bind_address(DEFAULT_EVENTS_ADDR, False)
    check_bind_address(DEFAULT_CONTROL_ADDR, False)


@pytest.mark.parametrize(
    "addr", ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:1", "tcp://localhost:5557", "tcp://[::1]:5557",
             "tcp://127.0.0.1:*", "tcp://127.0.0.1:0", "ipc:///tmp/kvscope.sock", "inproc://x"]
)
def test_loopback_and_ipc_accepted(addr):
    check_bind_address(addr, False)


@pytest.mark.parametrize("addr", ["tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://*:5557",
                                  "tcp://192.168.0.1:1", "tcp://eth0:5557", "tcp://[::]:5557"])
def test_remote_needs_allow_remote(addr):
    with pytest.raises(ValueError) as e:
        check_bind_address(addr, False)
    assert "\n" not in str(e.value) and "allow-remote" in str(e.value)
    check_bind_address(addr, True)


@pytest.mark.parametrize("addr", ["127.0.0.1:5557", "udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://127.0.0.1:x",
                                  "tcp://127.0.0.1:70000", "ipc://", ""])
def test_malformed_addresses(addr):
    with pytest.raises(ValueError):
        check_bind_address(addr, True)


def test_publisher_and_control_refuse_remote_bind():
    with pytest.raises(ValueError):
        ZmqPublisher("tcp://0.0.0.0:0")
    with pytest.raises(ValueError):
        ControlServer("tcp://10.0.0.1:0")


# ----------------------------------------------------------------------------- pub/sub


def test_late_subscriber_gets_events_and_malformed_frames_are_skipped():
    pub = ZmqPublisher(ANY)
    try:
        sub = Subscriber(pub.addr)  # joins after the publisher; zmq slow joiner: keep sending
        try:
            got = None
            end, i = time.monotonic() + DEADLINE_S, 0
            while got is None and time.monotonic() < end:
                pub.publish(b"\xc1garbage")  # raw bytes pass through the publisher untouched
                pub.publish(StepEvent(i, 0.0, 0.0, 1))
                got, i = sub.recv(5), i + 1
            assert isinstance(got, StepEvent)
            assert sub.malformed >= 1 and "malformed" in sub.last_error
        finally:
            sub.close()
    finally:
        pub.close()


def test_a_closing_publishers_last_events_and_bye_reach_a_subscriber_that_reads_late():
    """A publisher that sends its last steps and a bye, then closes: the subscriber is told of the
    disconnection before it reads them. It redialled first and zmq dropped them (a recording of a
    watched vLLM lost its bye on a loaded machine); it must read what it holds before it redials."""
    pub = ZmqPublisher(ANY)
    sub = Subscriber(pub.addr)
    try:
        end, i = time.monotonic() + DEADLINE_S, 0
        while sub.recv(5) is None and time.monotonic() < end:  # the slow joiner: until one arrives
            pub.publish(StepEvent(i, 0.0, 0.0, 1))
            i += 1
        while sub.recv(50) is not None:
            pass
        for j in range(200):
            pub.publish(StepEvent(10_000 + j, 0.0, 0.0, 1))
        pub.publish(ByeEvent(10_200, 0.0))
        pub.close()
        assert sub._monitor.poll(int(DEADLINE_S * 1000)), "the subscriber was never told of the disconnection"
        got = []
        while (ev := sub.recv(200)) is not None:
            got.append(ev)
        assert [e.step for e in got if e.type == "step"] == list(range(10_000, 10_200))
        assert got[-1].type == "bye"
    finally:
        sub.close()
        pub.close()


def test_subscriber_waits_for_a_publisher_that_does_not_exist_yet():
    probe = ZmqPublisher(ANY)  # find a free port, then free it
    addr = probe.addr
    probe.close(0)
    sub = Subscriber(addr)
    try:
        assert sub.recv(20) is None  # nothing there: returns on timeout
        pub = ZmqPublisher(addr)
        try:
            got = None
            end, i = time.monotonic() + DEADLINE_S, 0
            while got is None and time.monotonic() < end:
                pub.publish(ByeEvent(i, 0.0))
                got, i = sub.recv(5), i + 1
            assert isinstance(got, ByeEvent)
        finally:
            pub.close()
    finally:
        sub.close()


def test_stalled_subscriber_does_not_block_publish_and_drops_are_counted():
    """A subscriber that never reads: publish keeps returning, the loss is counted."""
    pub = ZmqPublisher(ANY, hwm=2, queue_size=100_000)
    sub = Subscriber(pub.addr, rcvhwm=1)
    try:
        # ~250 KB on the wire, encoded once: raw bytes take the same queue and NOBLOCK send as events,
        # without 400 encodes of 50,000 checked ints (minutes at nice 19 on a loaded machine)
        big = encode(StepEvent(1, 0.0, 0.0, 1, running=list(range(50_000))))
        # the subscription must be in place, or PUB just discards without back-pressure
        assert _until(lambda: (pub.publish(ByeEvent(0, 0.0)), sub._sock.poll(0))[1])
        pub.take_dropped()
        done = threading.Event()

        def publish_many():
            for _ in range(400):  # ~100 MB: far more than socket buffers hold
                pub.publish(big)
            done.set()

        t = threading.Thread(target=publish_many, daemon=True)
        t.start()
        assert done.wait(DEADLINE_S), "publish() blocked"
        dropped = 0
        assert _until(lambda: pub._queue.empty())
        dropped += pub.take_dropped()
        assert dropped > 0
        assert pub.take_dropped() == 0  # take resets
    finally:
        sub.close()
        pub.close(0)


def test_full_queue_drops_instead_of_blocking():
    pub = ZmqPublisher(ANY, queue_size=4)
    try:
        assert pub.queue_size == 4
        pub._closing.set()  # stop the sender thread so the queue fills
        pub._deadline = 0
        pub._thread.join(5)
        for i in range(50):
            pub.publish(StepEvent(i, 0.0, 0.0, 1))  # returns at once every time
        assert pub.take_dropped() >= 46
    finally:
        pub.close(0)


def test_publish_after_close_counts_as_dropped():
    pub = ZmqPublisher(ANY)
    pub.close()
    pub.publish(ByeEvent(1, 0.0))
    assert pub.take_dropped() == 1


def test_late_subscriber_reaches_same_state():
    """A subscriber that joins mid-run asks for a snapshot, applies deltas from there,
    and ends with the engine's block map."""
    pub = ZmqPublisher(ANY)
    ctl = ControlServer(ANY)
    synth = SimRun(seed=5)
    synth.take()
    stop = threading.Event()
    final = {}

    def engine():
        pub.publish(synth.hello())
        pub.publish(synth.snapshot())
        n = 0
        while not stop.is_set() and n < 100_000:
            for req in ctl.poll():
                if req.cmd == "snapshot":
                    pub.publish(synth.hello())
                    pub.publish(synth.snapshot())
                req.reply({"ok": True, "step": synth.done_step})
            for ev in synth.step():
                pub.publish(ev)
            n += 1
            time.sleep(0.0005)
        final.update(synth.owners())
        pub.publish(ByeEvent(synth.done_step, synth.t))

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    assert _until(lambda: synth.done_step >= 50), "the engine never got under way"  # join mid-run
    sub = Subscriber(pub.addr)
    client = ControlClient(ctl.addr, timeout_ms=REPLY_MS)
    try:
        owners = None
        last_step = None
        asked = 0
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            if owners is None and asked < 20:
                assert client.request("snapshot")["ok"]
                asked += 1
            ev = sub.recv(100)
            if ev is None:
                continue
            if ev.type == "snapshot" and owners is None:
                owners = BlockMap.from_snapshot(ev)
                last_step = ev.step
                stop.set()  # enough: let the engine finish and say bye
            elif ev.type == "step" and owners is not None:
                assert ev.step == last_step + 1, "lost an event"
                owners.apply_step(ev)
                last_step = ev.step
            elif ev.type == "bye" and owners is not None:
                break
        th.join(DEADLINE_S)
        assert owners is not None
        assert owners.owners() == final
        assert pub.take_dropped() == 0
    finally:
        stop.set()
        sub.close()
        client.close()
        ctl.close()
        pub.close()


def test_fanout_forwards_to_every_sink_even_if_one_fails():
    class Sink:
        def __init__(self, fail=False):
            self.got, self.closed, self.fail = [], False, fail

        def publish(self, ev):
            self.got.append(ev)
            if self.fail:
                raise OSError("disk full")

        def close(self):
            self.closed = True

    a, b, c = Sink(), Sink(fail=True), Sink()
    a.take_dropped = lambda: 2
    c.take_dropped = lambda: 3
    fan = FanOut([a, b, None, c])
    with pytest.raises(OSError):
        fan.publish(1)
    assert a.got == b.got == c.got == [1]
    assert fan.take_dropped() == 5  # the engine asks the fan-out for the publisher's count
    fan.close()
    assert a.closed and b.closed and c.closed


# ----------------------------------------------------------------------------- control


@pytest.fixture
def control():
    srv = ControlServer(ANY, workloads=["chat", "long"])
    cli = ControlClient(srv.addr, timeout_ms=REPLY_MS)
    stop = threading.Event()
    seen = []

    def engine():
        while not stop.is_set():
            for req in srv.poll():
                seen.append((req.cmd, req.args))
                req.reply({"ok": True, "echo": req.cmd, "args": req.args})
                req.reply({"ok": False})  # a second reply is ignored
            time.sleep(0.002)

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    yield srv, cli, seen
    stop.set()
    th.join(5)
    cli.close()
    srv.close()


def test_control_round_trip(control):
    srv, cli, seen = control
    assert cli.request("snapshot") == {"ok": True, "echo": "snapshot", "args": {}}
    assert cli.request("add", workload="chat", n=3)["args"] == {"workload": "chat", "n": 3}
    assert cli.request("burst", n=8)["ok"]
    assert cli.request("long")["ok"]
    for cmd in ("pause", "resume", "stop"):
        assert cli.request(cmd)["echo"] == cmd
    assert [c for c, _ in seen] == ["snapshot", "add", "burst", "long", "pause", "resume", "stop"]


@pytest.mark.parametrize(
    "cmd,args,fragment",
    [
        ("explode", {}, "unknown command"),
        ("add", {"n": 2}, "missing required field `workload`"),
        ("add", {"workload": "chat", "n": 0}, "Expected `int` >= 1 - at `$.n`"),
        ("add", {"workload": "chat", "n": "2"}, "Expected `int`, got `str` - at `$.n`"),
        ("add", {"workload": "nope", "n": 2}, "unknown workload"),
        ("pause", {"x": 1}, "unknown field `x`"),
        ("burst", {"n": True}, "Expected `int`, got `bool` - at `$.n`"),
    ],
)
def test_control_rejects_without_reaching_engine(control, cmd, args, fragment):
    srv, cli, seen = control
    r = cli.request(cmd, **args)
    assert r["ok"] is False and fragment in r["error"]
    assert seen == []


def test_control_malformed_and_oversize_messages(control):
    srv, cli, seen = control
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.addr)
    try:
        for payload in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"cmd": "stop", "evil": 1}),
                        msgpack.packb({1: 2}, strict_types=False)):
            sock.send(payload)
            assert sock.poll(REPLY_MS)
            r = msgpack.unpackb(sock.recv())
            assert r["ok"] is False and r["error"]
    finally:
        sock.close(0)
    # over the size limit: zmq drops the connection; the client times out, never hangs
    big = ControlClient(srv.addr, timeout_ms=300)
    try:
        r = big.request("add", workload="chat", n=1, pad="x" * 100_000)
        assert r["ok"] is False
    finally:
        big.close()
    assert seen == []
    assert cli.request("pause")["ok"]  # the server still works


def test_control_client_times_out_and_recovers():
    probe = ControlServer(ANY)
    addr = probe.addr
    probe.close()
    cli = ControlClient(addr, timeout_ms=100)
    try:
        assert cli.request("snapshot") == {"ok": False, "error": "timeout"}
        assert cli.request("snapshot") == {"ok": False, "error": "timeout"}  # REQ socket was recreated
        srv = ControlServer(addr)
        try:
            stop = threading.Event()

            def serve():
                while not stop.is_set():
                    for r in srv.poll():
                        r.reply()
                    time.sleep(0.002)

            th = threading.Thread(target=serve, daemon=True)
            th.start()
            r = {"ok": False}
            end = time.monotonic() + DEADLINE_S
            while not r["ok"] and time.monotonic() < end:  # the REQ socket reconnects to the new server
                r = cli.request("resume", timeout_ms=500)
            stop.set()
            th.join(5)
            assert r == {"ok": True}
        finally:
            srv.close()
    finally:
        cli.close()


def test_control_poll_never_blocks_with_nothing_pending():
    srv = ControlServer(ANY)
    try:
        for _ in range(100):
            assert srv.poll() == []
    finally:
        srv.close()
