"""A stand-in vLLM for the adapter tests: its /metrics text and its KV-event wire formats.

- Metrics come from prometheus_client itself (as vLLM's do), with vLLM V1's names,
  labels (model_name, engine) and histogram buckets.
- KV events: msgspec Structs mirroring vllm/distributed/kv_events.py in both encodings
  (``legacy=True``: array_like batches and events tagged by their first item; otherwise
  maps with a ``type`` key), published as ``topic | seq | payload`` on a PUB socket, with
  a ROUTER replay socket answering ``b"" | start seq`` with ``b"" | seq | payload``
  frames and a final seq -1.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
MODEL = "Qwen/Qwen3-0.6B"
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LENGTH_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]  # vLLM's 1-2-5 up to max_model_len 8192
CACHE_CONFIG = {"block_size": "16", "gpu_memory_utilization": "0.9", "swap_space": "4", "cache_dtype": "auto",
                "num_gpu_blocks": "4096", "num_cpu_blocks": "None", "enable_prefix_caching": "True"}


# ---- vLLM's classes, both encodings ---------------------------------------------------------
class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list
    medium: str | None


class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class Stored(Event, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class Removed(Event, tag="BlockRemoved"):
    block_hashes: list
    medium: str | None
    group_idx: int | None = None


class Cleared(Event, tag="AllBlocksCleared"):
    pass


class FakeKvPublisher:
    """PUB + ROUTER on loopback; ``publish`` keeps every batch for replay (``drop`` skips the PUB send)."""

    def __init__(self, *, legacy: bool, block_size: int = 16, connect_to: str | None = None,
                 replay_topic: bool = True) -> None:
        import zmq

        self.legacy = legacy
        self.replay_topic = replay_topic  # vLLM 0.32 on: replay answers carry the topic frame, as its PUB sends
        self.block_size = block_size
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        if connect_to is not None:  # vLLM with a host endpoint (tcp://HOST:PORT) connects instead of binding
            self.pub.connect(connect_to)
            self.addr = connect_to
        else:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.addr = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_addr = f"tcp://127.0.0.1:{rport}"
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_skips: set[int] = set()  # seqs the replay answer leaves out (a ROUTER that dropped them)
        self.seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def stored(self, hashes, parent, medium="GPU"):
        tokens = list(range(len(hashes) * self.block_size))
        if self.legacy:
            return LegacyStored(hashes, parent, tokens, self.block_size, None, medium, None)
        return Stored(hashes, parent, tokens, self.block_size, None, medium, None, group_idx=0)

    def removed(self, hashes, medium="GPU"):
        return LegacyRemoved(hashes, medium) if self.legacy else Removed(hashes, medium)

    def cleared(self):
        return LegacyCleared() if self.legacy else Cleared()

    def publish(self, events, ts: float = 0.0, drop: bool = False) -> int:
        batch = (LegacyBatch if self.legacy else Batch)(ts, list(events), 0)
        payload = msgspec.msgpack.encode(batch)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if not drop:
                self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        with self._lock:
            self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            topic = [b""] if self.replay_topic else []
            with self._lock:
                for seq, payload in self.buffer:
                    if seq >= first and seq not in self.replay_skips:
                        self.router.send_multipart([client, b"", *topic, seq.to_bytes(8, "big"), payload])
                self.router.send_multipart([client, b"", *topic, (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


class FakeMetricsServer:
    """GET /metrics in vLLM V1's shape; the test moves the numbers between scrapes."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        reg = self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             labels, registry=reg).labels(MODEL, "0")
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             labels, registry=reg).labels(MODEL, "0")
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason.",
                                       labels + ["reason"], registry=reg)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                        labels, registry=reg).labels(MODEL, "0")
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=reg).labels(MODEL, "0")
        self.prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                              registry=reg).labels(MODEL, "0")
        self.generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                  registry=reg).labels(MODEL, "0")
        self.queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels,
                               registry=reg).labels(MODEL, "0")
        self.hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels,
                            registry=reg).labels(MODEL, "0")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(MODEL, "0")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(MODEL, "0")
        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(MODEL, "0")

        # the series a diagnosis reads beyond the view's (vllm/v1/metrics/loggers.py names and buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKENS_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for "
                               "request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                                 "request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
                                "request.", REQUEST_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", LENGTH_BUCKETS)
        self.gen_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                            LENGTH_BUCKETS)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=reg)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     list(CACHE_CONFIG) + ["engine"], registry=reg)
        info.labels(**CACHE_CONFIG, engine="0").set(1)
        self.body_override: bytes | None = None
        self.kv_event_sources: dict | bytes | None = None  # GET /kv_event_sources (vLLM 0.32 on); None: 404
        self.version: str | None = None  # GET /version, as vLLM's OpenAI server answers it; None: 404
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                from prometheus_client import generate_latest

                if self.path == "/version" and fake.version is not None:
                    body = json.dumps({"version": fake.version}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path == "/kv_event_sources" and fake.kv_event_sources is not None:
                    src = fake.kv_event_sources
                    body = src if isinstance(src, bytes) else json.dumps(src).encode()  # bytes: served as they are
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = fake.body_override if fake.body_override is not None else generate_latest(fake.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def waiting_for(self, capacity: int, deferred: int = 0) -> None:
        """num_requests_waiting and its split by reason, as vLLM sets them together."""
        self.waiting.set(capacity + deferred)
        self.waiting_by_reason.labels(MODEL, "0", "capacity").set(capacity)
        self.waiting_by_reason.labels(MODEL, "0", "deferred").set(deferred)

    def finish(self, n: int, *, prompt: int, output: int, queue: float, e2e: float) -> None:
        """n requests finished, as vLLM's PrometheusStatLogger observes each FinishedRequestStats."""
        for _ in range(n):
            self.success.labels(MODEL, "0", "length").inc()
            self.prompt_len.observe(prompt)
            self.gen_len.observe(output)
            self.queue_time.observe(queue)
            self.e2e.observe(e2e)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
