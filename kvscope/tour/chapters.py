"""The tour's eight chapters: the lesson's ideas in order, each staged on the real engine.

Sizes are in blocks and tokens, so one script serves the tiny model on a CPU, a real model and
the sim: what a chapter waits for is a state of the scheduler, which every backend reaches.
Captions say what is about to happen and where to look; the cue's line says what happened.
"""

from __future__ import annotations

from kvscope.tour import cues
from kvscope.tour.script import Arrival, Beat, Chapter, Scene

LONG_PROMPT = 1024

_ch1 = Scene(
    "1-blocks", "Blocks and block tables",
    "The KV cache is a pool of fixed blocks of 16 tokens. Each request has a block table that maps its "
    "positions to blocks anywhere in the pool. Watch the block map: request #0 takes one more block each "
    "time it outgrows its last (Enter on it opens its detail, with its table).",
    "blockmap", {"mode": "chunked", "num_blocks": 64, "max_num_batched_tokens": 256},
    (Arrival(0, 100, 40), Arrival(0, 40, 40), Arrival(0, 70, 40)), cues.block_grew)

# the same twelve requests for both scenes: four seats, very different output lengths
_ch2_requests = tuple(Arrival(0, 24 + 4 * i, m) for i, m in enumerate((8, 48, 16, 64, 8, 32, 12, 56, 20, 40, 8, 24)))
_ch2 = (
    Scene("2a-continuous", "Continuous batching",
          "Twelve requests, four seats. With iteration-level batching the scheduler runs every step: a finished "
          "request leaves and a waiting one takes its seat at once. Watch RUNNING and the batch line.",
          "running", {"mode": "continuous", "num_blocks": 128, "max_num_seqs": 4, "max_num_batched_tokens": 512},
          _ch2_requests, cues.joined_as_one_left),
    Scene("2b-static", "Static batching, same requests",
          "The same twelve requests, batched statically: a batch forms only when the last one is done. Watch "
          "WAITING: the queue stands still while the batch's slowest row finishes alone.",
          "waiting", {"mode": "static", "num_blocks": 128, "max_num_seqs": 4, "max_num_batched_tokens": 512},
          _ch2_requests, cues.static_waits_for_slowest),
)

_ch3_requests = (Arrival(0, 32, 160, count=4), Arrival(6, LONG_PROMPT, 8))
_ch3 = (
    Scene("3a-chunked", "Chunked prefill",
          f"Four requests are decoding when a {LONG_PROMPT}-token prompt arrives. With chunked prefill each step "
          "packs the decodes first, then a chunk of the prompt up to the 64-token budget. Watch the batch line: "
          "chunk after chunk, beside the decodes.",
          "batch", {"mode": "chunked", "num_blocks": 160, "max_num_batched_tokens": 64},
          _ch3_requests, cues.chunk_in_flight(LONG_PROMPT),
          then=(Beat("Chunked prefill: the gaps stay small",
                     "Let the prompt finish. The decoders never missed a step while it went in, so the gap "
                     "between their tokens (ITL) stays small. Watch the ITL histogram.",
                     "latency", cues.chunks_beside_decodes(LONG_PROMPT)),)),
    Scene("3b-whole", "Whole prefill: the spike",
          "The same requests without chunking: the long prompt is prefilled whole, in one big step. Chunking "
          "does not make the work smaller; it spreads it. Watch the ITL histogram's tail.",
          "latency", {"mode": "continuous", "num_blocks": 160, "max_num_batched_tokens": 2048},
          _ch3_requests, cues.whole_prefill_spike(LONG_PROMPT, "3a-chunked")),
)

_ch4_requests = (Arrival(0, 32, 64, count=8),)
_ch4_settings = {"mode": "chunked", "num_blocks": 24, "max_num_seqs": 16, "max_num_batched_tokens": 128}
_ch4 = (
    Scene("4a-recompute", "A full pool preempts",
          "Eight requests start in a pool of 24 blocks that cannot hold them all once they grow. When a "
          "running request needs a block and none is free, the newest is preempted. Watch the block map fill, "
          "then PREEMPTED.",
          "preempted", {**_ch4_settings, "preemption": "recompute"}, _ch4_requests, cues.preempted("recompute")),
    Scene("4b-swap", "Swap instead of recompute",
          "The same burst, with preemption by swap: the victim's KV is copied to CPU memory instead of thrown "
          "away, and copied back when there is room. Watch PREEMPTED (swapped) and the swap counter.",
          "preempted", {**_ch4_settings, "preemption": "swap", "swap_space": 0.05}, _ch4_requests,
          cues.preempted("swap")),
)

_ch5 = Scene(
    "5-prefix", "Prefix caching",
    "Four requests share a 128-token system prompt. The first computes it; its full blocks stay in the cache, "
    "keyed by their tokens. Watch the block map: the next requests find those blocks and skip their prefill.",
    "blockmap", {"mode": "chunked", "num_blocks": 96, "max_num_batched_tokens": 256, "prefix_caching": True},
    (Arrival(0, 144, 24, prefix_len=128), Arrival(3, 150, 24, count=3, prefix_len=128)), cues.prefix_hit)

_ch6 = Scene(
    "6-parallel", "Parallel sampling, copy-on-write",
    "One prompt, four samples (n=4). The samples share the prompt's blocks instead of copying them; only the "
    "partly filled last block is copied, the first time a sample writes to it. Watch the block map.",
    "blockmap", {"mode": "chunked", "num_blocks": 64, "max_num_batched_tokens": 256},
    (Arrival(0, 100, 24, n=4),), cues.shared_by(4), temperature=0.8)

_ch7_requests = tuple(Arrival(0, 150 + 14 * i, 448) for i in range(8))
_ch7 = (
    Scene("7a-reserved", "Reservation wastes memory",
          "Eight requests, each allowed 448 new tokens. Static batching reserves prompt + max_tokens for each "
          "one up front, contiguous, before a token is generated. Watch the block map and the KV line: most "
          "of what is held is empty.",
          "blockmap", {"mode": "static", "num_blocks": 400, "max_num_seqs": 8, "max_num_batched_tokens": 2048},
          _ch7_requests, cues.waste_measured(32)),
    Scene("7b-paged", "Paged blocks waste little",
          "The same requests with paged blocks: a request takes a block only when it needs one, so the only "
          "empty slots are in each request's last block. Watch the same map.",
          "blockmap", {"mode": "chunked", "num_blocks": 400, "max_num_seqs": 8, "max_num_batched_tokens": 2048},
          _ch7_requests, cues.waste_measured(32, against="7a-reserved")),
)

_ch8_settings = {"mode": "chunked", "num_blocks": 40, "max_num_seqs": 16, "max_num_batched_tokens": 128}
_ch8_requests = tuple(Arrival(2 * i, 48, 48) for i in range(16))
_ch8 = (
    Scene("8a-diagnose", "The reader names the bottleneck",
          "A steady stream of requests into a small pool. The diagnosis (key d) reads the engine's own steps, "
          "names one bottleneck with its evidence, and orders the knobs to turn. Watch PREEMPTED, then this "
          "caption.",
          "preempted", _ch8_settings, _ch8_requests, cues.diagnosed(48),
          then=(Beat("The run to compare against",
                     "Let the run play out to its last request: its preemptions, the steps it took to serve "
                     "everyone and its TTFT p99 are what the knob has to beat. Watch the latency panel.",
                     "latency", cues.all_served(len(_ch8_requests))),)),
    Scene("8b-what-if", "The what-if checks the knob",
          "The same requests again, with the knob the diagnosis named turned, served to the end and compared: "
          "the knob earns its place only if the figures move. Watch PREEMPTED and the latency panel.",
          "preempted", cues.knob_applied(_ch8_settings, "8a-diagnose"), _ch8_requests,
          cues.all_served(len(_ch8_requests), against="8a-diagnose")),
)

CHAPTERS: tuple[Chapter, ...] = (
    Chapter(1, "Blocks and block tables", (_ch1,)),
    Chapter(2, "Continuous against static batching", _ch2),
    Chapter(3, "Chunked prefill", _ch3),
    Chapter(4, "A full pool preempts", _ch4),
    Chapter(5, "Prefix caching", (_ch5,)),
    Chapter(6, "Parallel sampling", (_ch6,)),
    Chapter(7, "Fragmentation", _ch7),
    Chapter(8, "The reader", _ch8),
)
