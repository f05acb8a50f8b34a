"""Watching a running vLLM: a metrics poller and a KV-event subscriber with gap replay.

Two daemon threads feed one VllmState under a lock; the TUI reads a consistent copy of
the numbers it draws. Everything from the network is bounded (message size, receive
queue, metric text) and anything malformed is counted and skipped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

from kvscope.vllm.watch.cache import CacheView
from kvscope.vllm.watch.metrics import MAX_TEXT_BYTES, MetricsError, MetricsView, parse
from kvscope.vllm.watch.wire import END_SEQ, WireError, decode_batch, decode_seq, encode_seq

MAX_MESSAGE_BYTES = 16 << 20
RECV_HWM = 10_000
REPLAY_TIMEOUT_S = 5.0  # silence that ends a replay answer (a loaded publisher may pause a while)
POLL_MS = 100
# A seq this far from the last one is not a gap to replay (vLLM buffers 10,000 batches) but a publisher
# that restarted or broke: the view says so and follows the new numbers instead of stalling on the old.
MAX_SEQ_JUMP = 1 << 20
MAX_STALE = 4 * RECV_HWM  # more already-seen live batches in a row than a replay's overlap can explain
SCRAPE_TIMEOUT_S = 5.0  # one whole scrape, connect to last byte (a per-read timeout alone lets a trickle run on)


def scrape_client(interval: float):
    """The HTTP client for /metrics: no compression asked for (a gzip bomb is never inflated), and a
    per-read timeout short enough that a silent server cannot hold a scrape past its budget for long."""
    import httpx

    per_read = min(SCRAPE_TIMEOUT_S, interval * 2 + 1.0)
    return httpx.Client(timeout=httpx.Timeout(per_read), headers={"accept-encoding": "identity"})


@dataclass
class KvStats:
    received: int = 0
    replayed: int = 0
    malformed: int = 0
    gaps: int = 0
    missed: int = 0  # batches lost for good (not in the replay buffer either)
    resets: int = 0  # the seq jumped past any plausible gap (a restarted or broken publisher): followed anew
    last_seq: int = -1
    stale: int = 0  # live batches in a row at or below last_seq (a few follow every replay; endless ones: a reset)
    reconnects: int = 0  # the connection dropped (the publisher left, or sent a message over the size limit)
    last_error: str | None = None


class NullListener:
    """What the source tells about each thing it applies; `kvscope record --vllm` listens
    (adapters.vllm_record). Called with the source's lock held, just before the state moves,
    so the state it sees is the one the thing applies to."""

    def scraped(self, scrape) -> None:
        pass

    def scrape_failed(self, message: str) -> None:
        pass

    def applied(self, seq: int, batch, replayed: bool) -> None:
        pass


NULL_LISTENER = NullListener()


@dataclass(frozen=True)
class ReplayPosition:
    """Where a recorded vLLM's playback is (adapters.vllm_replay); the header draws it."""

    name: str
    playing: bool
    done: bool
    speed: float
    t: float
    t_total: float
    tick: int
    last_tick: int


@dataclass
class VllmState:
    url: str | None
    kv_addr: str | None
    replay_addr: str | None
    metrics: MetricsView = field(default_factory=MetricsView)
    cache: CacheView = field(default_factory=CacheView)
    kv: KvStats = field(default_factory=KvStats)
    version: int = 0
    replay: ReplayPosition | None = None  # set when this is a recorded run played back
    kv_bound: bool = False  # the KV-event socket is bound here (vLLM connects to it), not connected

    def copy(self) -> "VllmState":
        """What the screen draws, copied under the source's lock while the threads keep writing."""
        return replace(self, metrics=self.metrics.copy(), cache=self.cache.copy(), kv=replace(self.kv))


def apply_batch(state: VllmState, seq: int, batch, replayed: bool) -> None:
    """One decoded KV batch into the view (live, or from a recorded trace)."""
    state.cache.apply(batch)
    state.kv.last_seq = seq
    if replayed:
        state.kv.replayed += 1
    else:
        state.kv.received += 1
    state.version += 1


class VllmSource:
    """Starts the threads; ``lock`` guards ``state``; ``close`` stops them."""

    def __init__(self, url: str | None = None, kv_events: str | None = None, kv_replay: str | None = None, *,
                 interval: float = 1.0, window_s: float = 30.0, listener: NullListener = NULL_LISTENER) -> None:
        if url is None and kv_events is None:
            raise ValueError("watching vLLM needs --vllm URL or --kv-events ADDR")
        self.listener = listener
        self.url = url.rstrip("/") if url else None
        self.interval = max(0.1, float(interval))
        self.state = VllmState(url, kv_events, kv_replay)
        self.state.metrics.window_s = window_s
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "VllmSource":
        if self.url:
            self._spawn(self._poll_metrics, "kvscope-vllm-metrics")
        if self.state.kv_addr:
            self._spawn(self._subscribe, "kvscope-vllm-kv")
        return self

    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2.0)

    # -- metrics --------------------------------------------------------------------
    def scrape_once(self, client, budget_s: float | None = None) -> None:
        """One GET /metrics, bounded while it streams: at most MAX_TEXT_BYTES, and at most
        ``budget_s`` seconds in all (default: the scrape timeout), and it stops when the source does.
        An endless or trickling body is a failed scrape, never a growing buffer or a late return."""
        try:
            scrape = parse(self._fetch(client, SCRAPE_TIMEOUT_S if budget_s is None else budget_s), time.time())
        except MetricsError as e:
            self._failed(str(e))
            return
        except Exception as e:  # network errors: httpx.HTTPError, OSError
            self._failed(f"GET {self.url}/metrics: {type(e).__name__}: {str(e)[:100]}")
            return
        with self.lock:
            self.listener.scraped(scrape)
            self.state.metrics.add(scrape)
            self.state.metrics.last_error = None
            self.state.version += 1

    def _fetch(self, client, budget_s: float) -> str:
        deadline = time.monotonic() + max(0.0, budget_s)
        url = f"{self.url}/metrics"
        with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise MetricsError(f"GET {url}: HTTP {resp.status_code}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_TEXT_BYTES:
                raise MetricsError(f"GET {url}: body of {declared} bytes is over the {MAX_TEXT_BYTES}-byte limit")
            chunks, size = [], 0
            for chunk in resp.iter_raw():  # raw: a compressed body is refused below, never inflated
                size += len(chunk)
                if size > MAX_TEXT_BYTES:
                    raise MetricsError(f"GET {url}: body over the {MAX_TEXT_BYTES}-byte limit (stopped reading)")
                if time.monotonic() > deadline or self._stop.is_set():
                    raise MetricsError(f"GET {url}: body not complete within {budget_s:g} s (stopped reading)")
                chunks.append(chunk)
            if resp.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
                raise MetricsError(f"GET {url}: compressed body ({resp.headers['content-encoding'][:20]}) "
                                   "not accepted")
        return b"".join(chunks).decode("utf-8", errors="replace")

    def _failed(self, message: str) -> None:
        with self.lock:
            self.listener.scrape_failed(message)
            self.state.metrics.fail(message)
            self.state.version += 1

    def _poll_metrics(self) -> None:
        with scrape_client(self.interval) as client:
            while not self._stop.is_set():
                self.scrape_once(client)
                self._stop.wait(self.interval)

    # -- KV events ------------------------------------------------------------------
    def _socket(self, kind: int, addr: str, bind: bool = False):
        import zmq

        sock = zmq.Context.instance().socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            (sock.bind if bind else sock.connect)(addr)
        except Exception:
            sock.close(0)
            raise
        return sock

    def _kv_mode(self) -> tuple[bool, str]:
        """(bind, address) of the KV-event socket: ``bind:ADDR``, or an address the server at --vllm URL
        says its publisher connects to (vllm_endpoints), is bound; any other is connected to."""
        from kvscope.vllm.watch.endpoints import split_mode, vllm_connects_to

        bind, addr = split_mode(self.state.kv_addr)
        if not bind and self.url:
            with scrape_client(self.interval) as client:
                bind = vllm_connects_to(self.url, client, addr)
        if bind:
            from kvscope.protocol.pubsub import check_bind_address

            try:
                check_bind_address(addr)  # loopback only: a KV view never opens a port to the network
            except ValueError:
                raise ValueError("a KV view binds loopback only (give vLLM a 127.0.0.1 endpoint)") from None
        with self.lock:
            self.state.kv_bound = bind
        return bind, addr

    def _subscribe(self) -> None:
        import zmq

        from kvscope.protocol.pubsub import redial_if_dropped

        from kvscope.vllm.watch.endpoints import split_mode

        bind, addr = split_mode(self.state.kv_addr)
        try:
            bind, addr = self._kv_mode()
            sub = self._socket(zmq.SUB, addr, bind)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
        except Exception as e:  # zmq.ZMQError, or an address refused for binding
            with self.lock:
                self.state.kv.last_error = f"cannot {'bind' if bind else 'connect'} {self.state.kv_addr}: " \
                                           f"{str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
            return
        # one message over MAXMSGSIZE would leave the view deaf to that publisher for good: the monitor
        # tells of each disconnection, and redial_if_dropped connects afresh (counted)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # Batches published before this view started are only in the replay buffer.
        self.replay_from(0)
        try:
            while not self._stop.is_set():
                if sub.poll(POLL_MS):
                    self.handle_frames(sub.recv_multipart())
                    continue
                # nothing left to read: a redial now loses none of what the publisher sent before it went
                # (a bound socket has nothing to redial: vLLM's side reconnects)
                if not bind and redial_if_dropped(sub, monitor, addr):
                    with self.lock:
                        self.state.kv.reconnects += 1
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close()

    def handle_frames(self, frames: list[bytes]) -> None:
        """One PUB message: topic | seq | payload. Replays the gap before it if there is one."""
        kv = self.state.kv
        if len(frames) != 3:
            with self.lock:
                kv.malformed += 1
                kv.last_error = f"message of {len(frames)} frames, expected topic | seq | payload"
            return
        try:
            seq = decode_seq(frames[1])
        except WireError as e:
            with self.lock:
                kv.malformed += 1
                kv.last_error = str(e)
            return
        if kv.last_seq >= 0 and not -MAX_SEQ_JUMP <= seq - kv.last_seq <= MAX_SEQ_JUMP:
            self._reset(seq, f"KV-event seq jumped from {kv.last_seq} to {seq}")
        if seq <= kv.last_seq:
            with self.lock:
                kv.stale += 1
                if kv.stale <= MAX_STALE:
                    return  # already applied (from a replay)
            self._reset(seq, f"{MAX_STALE} KV-event batches in a row at or below seq {kv.last_seq}, last {seq}")
        kv.stale = 0
        if kv.last_seq < 0 and seq > MAX_SEQ_JUMP and not self.state.replay_addr:
            kv.last_seq = seq - 1  # joined a long-running stream with no replay: nothing to count as missed
        if seq > kv.last_seq + 1:
            with self.lock:
                kv.gaps += 1
            self.replay_from(kv.last_seq + 1)
            if seq <= kv.last_seq:
                return
            if seq > kv.last_seq + 1:
                with self.lock:
                    kv.missed += seq - kv.last_seq - 1
        self._apply(seq, frames[2], replayed=False)

    def _reset(self, seq: int, why: str) -> None:
        """Follow the publisher's new numbers from here (a visible notice, counted; no batch is counted
        missed for a jump no replay could fill). The cached blocks stay: vLLM says when it clears them."""
        with self.lock:
            kv = self.state.kv
            kv.resets += 1
            kv.gaps += 1
            kv.last_seq = seq - 1  # the batch in hand comes next: nothing to replay before it
            kv.stale = 0
            kv.last_error = f"{why}: past any plausible gap, followed as a new stream (reset {kv.resets})"
            self.state.version += 1

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        kv = self.state.kv
        try:
            batch = decode_batch(payload)
        except WireError as e:
            with self.lock:
                kv.malformed += 1
                kv.last_error = str(e)
                kv.last_seq = max(kv.last_seq, seq)
            return
        with self.lock:
            self.listener.applied(seq, batch, replayed)
            apply_batch(self.state, seq, batch, replayed)

    def replay_from(self, start: int) -> int:
        """Ask the ROUTER for every buffered batch from ``start``; returns how many were applied."""
        if not self.state.replay_addr:
            return 0
        import zmq

        applied = 0
        try:
            dealer = self._socket(zmq.DEALER, self.state.replay_addr)
        except zmq.ZMQError as e:
            with self.lock:
                self.state.kv.last_error = f"cannot connect {self.state.replay_addr}: {e}"
            return 0
        try:
            dealer.send_multipart([b"", encode_seq(start)])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while time.monotonic() < deadline and not self._stop.is_set():
                if not dealer.poll(POLL_MS):
                    continue
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM 0.32 on answers topic | seq | payload, as its PUB sends
                    frames = frames[1:]
                if len(frames) != 2:
                    with self.lock:
                        self.state.kv.malformed += 1
                    continue
                try:
                    seq = decode_seq(frames[0])
                except WireError:
                    with self.lock:
                        self.state.kv.malformed += 1
                    continue
                if seq == END_SEQ:
                    break
                if seq > self.state.kv.last_seq:
                    hole = seq - max(self.state.kv.last_seq + 1, start)
                    if hole > MAX_SEQ_JUMP:  # not a gap: a replay that answers nonsense, or a stream
                        if self.state.kv.last_seq >= 0:  # joined far from 0 (then there is nothing to miss)
                            with self.lock:
                                self.state.kv.malformed += 1
                                self.state.kv.last_error = (f"replay answered seq {seq} for a gap from {start}: "
                                                            "past any plausible gap, ignored")
                            continue
                        hole = 0
                    if hole > 0:  # not in the answer either (dropped by the ROUTER, or past its buffer)
                        with self.lock:
                            self.state.kv.missed += hole
                    self._apply(seq, frames[1], replayed=True)
                    applied += 1
                deadline = time.monotonic() + REPLAY_TIMEOUT_S
        finally:
            dealer.close()
        return applied
