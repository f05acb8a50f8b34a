"""`kvscope serve --engine vllm`: a real vLLM server on kvscope's model, watched from inside and from outside.

kvscope starts vLLM (kvscope.vllm.launch.server), says where everything listens and how to watch it,
and stays in the foreground until Ctrl-C or SIGTERM, which stop vLLM's whole process group. Without
--http it runs the workload once against vLLM's API on a loopback port and prints a summary, as
`kvscope serve` does; --forever keeps the workload coming (`kvscope demo --engine vllm`). --record
FILE records the watched stream (one file per data-parallel rank); a vLLM that dies mid-run leaves it
closed and readable.

Ports, from the event address's port P (default 5557, or the first free run of ports when taken), for
N data-parallel ranks: the watched scheduler's events P..P+N-1, their control sockets P+N..P+2N-1
(answering `snapshot`; --control names another base), vLLM's KV events P+2N.. and their replay P+3N..,
rank r on base + r as vLLM offsets its own KV-event ports.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from kvscope.cli.common import UsageError, check_address, check_output_path, engine_settings
from kvscope.cli.stop_signals import StopSignals

# serve's flags that mean something only to kvscope's own engine: given with --engine vllm, one line each
KVSCOPE_ONLY = {"json": "--json", "step_clock": "--step-clock", "metrics_port": "--metrics-port (vLLM's /metrics "
                "is on its HTTP port)", "trust_request_chat_template": "--trust-request-chat-template",
                "slo": "--slo", "cost_per_hour": "--cost-per-hour"}
DEMO_IN_FLIGHT = 48  # the workload's requests unfinished at once before new ones are refused (and counted)


def run_vllm(args: argparse.Namespace) -> int:
    from kvscope.vllm.launch import flags as vf
    from kvscope.vllm.launch import ports as vp
    from kvscope.vllm.launch import server as vs

    dp = vf.check_vllm_args(args.vllm_args)
    for key, flag in KVSCOPE_ONLY.items():
        if getattr(args, key, None):
            raise UsageError(f"{flag} is kvscope's engine's; with --engine vllm give vLLM's flags after --")
    if args.kv_events_vllm_encoding != "map":
        raise UsageError("--kv-events-vllm-encoding: vLLM 0.32 publishes the map encoding")
    python = vf.vllm_python()  # a missing .venv-vllm is one line, before anything is fetched or converted
    settings = engine_settings(args)
    model = settings.get("model") or "smollm2-135m"
    choice = vf.engine_choice(settings)
    traffic = args.forever or not args.http
    if traffic:
        from kvscope.workload import load_spec

        load_spec(args.workload)
    if args.record and args.events == "none":
        raise UsageError("--record records the watched scheduler's events: leave out --events none")
    for path in (_rank_path(args.record, r, dp) for r in range(dp)) if args.record else ():
        check_output_path(path, inputs=[args.workload], kind="kvtrace")
    addrs = _addresses(args, dp)
    model_dir = vf.checkpoint(model, choice.dtype)
    spec = _launch_spec(args, dp, python, model_dir, model, choice, addrs)
    server = vs.VllmServer(spec)
    vs.say(f"starting vLLM ({python} -m {vs.API_SERVER}) on {model_dir}; its log: {server.log_path}")
    vs.say(vs.FIRST_START)
    relay = vp.KvEventsRelay([(vp.offset_port(addrs["kv_inside"], r), vp.offset_port(addrs["kv"], r))
                              for r in range(dp)], allow_remote=args.allow_remote)
    recorders = _Recorders(args.record, spec) if args.record else None
    run = None
    failure: str | None = None
    with StopSignals() as signals:
        try:
            server.start()
            server.wait_ready(on_wait=_Progress(), stop=signals.stop)
            _say_where(spec, server, addrs["kv"])
            if traffic:
                run = _Traffic(args, spec, model_dir, signals.stop)
            while not signals.stop.is_set():
                if server.exited() is not None:
                    failure = server.failure("vLLM exited")
                    break
                if run is not None and run.finished():
                    break
                signals.stop.wait(0.2)
        except KeyboardInterrupt:
            pass
        except vs.VllmStartError as e:
            failure = str(e)
        finally:
            signals.ignore()  # a second Ctrl-C must not cut vLLM's shutdown or a trace's index short
            if run is not None:
                run.stop()
                preemptions = server.counter("num_preemptions") if server.exited() is None else None
            if server.proc is not None and server.exited() is None:
                vs.say("stopping vLLM ...")
            code = server.stop()
            relay.close()
            if recorders is not None:  # a vLLM that died sends no bye: nothing to wait for
                recorders.close(wait_bye_s=0.0 if failure else 5.0)
    if run is not None:
        run.print_summary(preemptions)
    if failure is not None:
        raise UsageError(failure)
    vs.say(f"vLLM stopped (code {code}); its log: {server.log_path}")
    return 0


def _launch_spec(args, dp: int, python: str, model_dir: str, model: str, choice, addrs: dict):
    """What vLLM is started with: kvscope's flags as vLLM's, the addresses, the KV cache, the threads."""
    from dataclasses import replace

    from kvscope.vllm.launch import flags as vf
    from kvscope.vllm.launch import server as vs

    kv_gib = choice.kv_cache_gib
    if kv_gib is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ and \
            vf.flag_value(args.vllm_args, ("--gpu-memory-utilization",)) is None:
        kv_gib = vf.default_kv_cache_gib(dp)
        vs.say(f"vLLM's KV cache: {kv_gib} GiB{' per rank' if dp > 1 else ''} (VLLM_CPU_KVCACHE_SPACE, kvscope's "
               f"rule: half the available memory, at most 4 GiB; --kv-cache-space N sets it)")
    names = args.served_model_name or [model]
    spec = vs.LaunchSpec(
        python=python, model_dir=model_dir, served_model_name=names[0], more_names=tuple(names[1:]),
        host=addrs["http"][0], port=addrs["http"][1], events_addr=addrs["events"] or "",
        kv_events_addr=addrs["kv_inside"], kv_replay_addr=addrs["replay"], dp_size=dp, dtype=choice.dtype,
        engine_flags=choice.flags, vllm_args=tuple(args.vllm_args), api_key=_api_key(args),
        allow_remote=args.allow_remote, cpu_bind=vf.cpu_binding(choice.cpu_threads, dp), kv_cache_gib=kv_gib,
        extra_env={vs.CONTROL_ENV: addrs["control"]} if addrs["control"] else {})
    return spec if addrs["events"] else replace(spec, extra_env={})


def _api_key(args) -> str | None:
    return args.api_key or os.environ.get("KVSCOPE_API_KEY") or None


def _addresses(args, dp: int) -> dict:
    """HTTP host and port, and the event, control and KV-event addresses of rank 0 (docs/VLLM.md, ports)."""
    from kvscope.vllm.launch import ports as vp
    from kvscope.vllm.launch import server as vs
    from kvscope.protocol.transport import DEFAULT_EVENTS_ADDR
    from kvscope.serve.frontend import parse_host_port

    if args.http:
        host, port = parse_host_port(args.http, args.allow_remote)
        port = vp.free_http(host, port, movable=False)
    else:  # the workload's own server: vLLM's default port on loopback, or a free one
        host = vs.DEFAULT_HTTP[0]
        port = vp.free_http(host, vs.DEFAULT_HTTP[1], movable=True)
    out = {"http": (host, port), "events": None, "control": None}
    events = None if args.events == "none" else args.events
    for flag, addr in (("--events", events), ("--kv-events-vllm", args.kv_events_vllm),
                       ("--kv-replay-vllm", args.kv_replay_vllm)):
        if addr:
            if not addr.startswith("tcp://"):
                raise UsageError(f"{flag} {addr}: vLLM's ranks need tcp://HOST:PORT")
            check_address(addr, bind=True, allow_remote=args.allow_remote)
    if args.events != "none":
        # the default: a run of 4 x ranks free ports (events, control, KV events, replay); a given address: its ranks
        base = vp.free_run(events or DEFAULT_EVENTS_ADDR, 4 * dp if events is None else dp, movable=events is None)
        out["events"] = base
        if args.control == "none":  # watchers then wait for the periodic snapshot
            out["control"] = None
        elif args.control:
            if not args.control.startswith("tcp://"):
                raise UsageError(f"--control {args.control}: vLLM's ranks need tcp://HOST:PORT")
            check_address(args.control, bind=True, allow_remote=args.allow_remote)
            out["control"] = vp.free_run(args.control, dp, movable=False)
        else:
            out["control"] = vp.free_run(vp.offset_port(base, dp), dp, movable=True)
        default_kv = vp.offset_port(base, 2 * dp)
        default_replay = vp.offset_port(base, 3 * dp)
    else:
        default_kv, default_replay = f"tcp://127.0.0.1:{vs.KV_EVENTS_PORT}", f"tcp://127.0.0.1:{vs.KV_REPLAY_PORT}"
    out["kv"] = args.kv_events_vllm or vp.free_run(default_kv, dp, movable=True)
    out["kv_inside"] = vp.free_run("tcp://127.0.0.1:0", dp, movable=True)  # vLLM's PUB connects here (the relay)
    out["replay"] = args.kv_replay_vllm or vp.free_run(default_replay, dp, movable=True)
    if args.kv_events_vllm:
        vp.free_run(args.kv_events_vllm, dp, movable=False)
    if args.kv_replay_vllm:
        vp.free_run(args.kv_replay_vllm, dp, movable=False)
    return out


class _Progress:
    """vLLM's start, said while it lasts: one line redrawn each second on a terminal, a line a phase in a log."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_phase = None

    def __call__(self, seconds: float, phase: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r\x1b[Kkvscope: starting vLLM … {seconds:.0f} s · {phase}")
            sys.stderr.flush()
        elif phase != self.last_phase:
            print(f"kvscope: starting vLLM … {seconds:.0f} s · {phase}", file=sys.stderr, flush=True)
        self.last_phase = phase


def _say_where(spec, server, kv_public: str) -> None:
    from kvscope.vllm.launch import server as vs
    from kvscope.protocol.transport import DEFAULT_CONTROL_ADDR, DEFAULT_EVENTS_ADDR

    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")
    vs.say(f"vLLM ready in {time.monotonic() - server.started_at:.0f} s; listening on {spec.url} "
           f"(OpenAI API; /metrics, /health)")
    ranks = spec.rank_addresses()
    if spec.events_addr:
        control = spec.extra_env.get(vs.CONTROL_ENV)
        if spec.dp_size == 1:
            cmd = "kvscope tui"
            if spec.events_addr != DEFAULT_EVENTS_ADDR:
                cmd += f" --connect {spec.events_addr}"
            if control != DEFAULT_CONTROL_ADDR:
                cmd += f" --control {control}"
            vs.say(f"vLLM's scheduler, step by step, on {spec.events_addr}; watch it: {cmd}")
        else:
            cmd = "kvscope tui --replicas " + str(spec.dp_size)
            if spec.events_addr != DEFAULT_EVENTS_ADDR:
                cmd += f" --connect {spec.events_addr}"
            vs.say(f"{spec.dp_size} data-parallel ranks, each its scheduler's steps on "
                   f"{', '.join(r[0] for r in ranks)}; watch them side by side: {cmd}")
    kv = f"--kv-events {kv_public}" + (f" --kv-replay {ranks[0][2]}" if ranks[0][2] else "")
    vs.say(f"from outside (/metrics and KV events): kvscope tui --vllm {spec.url} {kv}")


class _Traffic:
    """The workload sent to vLLM's API: once (then the run ends) or, with --forever, until stopped."""

    def __init__(self, args, spec, model_dir: str, stop: threading.Event) -> None:
        from kvscope import workload as wl
        from kvscope.vllm.launch.client import CompletionsClient, WorkloadDriver

        vocab, reserved = _vocab(model_dir)
        spec_w = wl.load_spec(args.workload)
        max_prompt = _max_prompt(args, model_dir)
        if args.forever:
            items = wl.generate_forever(spec_w, vocab_size=vocab, seed=args.seed or 0, reserved_ids=reserved,
                                        max_prompt_len=max_prompt, burst_every_s=args.burst_every)
            in_flight = min(args.max_waiting, DEMO_IN_FLIGHT)
        else:
            items = wl.generate_iter(spec_w, vocab_size=vocab, num_requests=args.num_requests, seed=args.seed or 0,
                                     max_prompt_len=max_prompt, reserved_ids=reserved)
            in_flight = args.max_waiting
        client = CompletionsClient(spec.host, spec.port, spec.served_model_name, api_key=spec.api_key)
        self.forever = args.forever
        self.driver = WorkloadDriver(client, in_flight)
        self._stop = threading.Event()
        self._outer = stop
        self._thread = threading.Thread(target=self.driver.run, args=(items, self._stop), daemon=True,
                                        name="kvscope-vllm-workload")
        self._thread.start()

    def finished(self) -> bool:
        return not self.forever and not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def print_summary(self, preemptions: int | None) -> None:
        from kvscope.engine.metrics import fmt_ms
        from kvscope.quantiles import percentile

        done = self.driver.done
        ttft = [c.ttft for c in done if c.ttft is not None]
        itl = [x for c in done for x in c.itl]
        tokens = sum(len(c.token_ids) for c in done)
        ends = [c.times[-1] for c in done if c.times]
        span = (max(ends) - self.driver.started) if ends else 0.0
        rows = [("requests", f"{len(done)}" + (f" ({self.driver.refused} refused: too many in flight)"
                                               if self.driver.refused else "")
                 + (f" ({self.driver.errors} failed: {self.driver.last_error})" if self.driver.errors else "")),
                ("output tokens", f"{tokens}"), ("duration", f"{span:.2f} s"),
                ("output tok/s", f"{tokens / span:.1f}" if span > 0 else "-"),
                ("TTFT mean / p50 / p99", f"{fmt_ms(sum(ttft) / len(ttft) if ttft else None)} / "
                                          f"{fmt_ms(percentile(ttft, 50))} / {fmt_ms(percentile(ttft, 99))}"),
                ("ITL p50 / p99", f"{fmt_ms(percentile(itl, 50))} / {fmt_ms(percentile(itl, 99))}"),
                ("preemptions", "-" if preemptions is None else f"{preemptions:.0f} (vLLM's /metrics)")]
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n(measured by the client, over vLLM's API)")


def _vocab(model_dir: str) -> tuple[int, int]:
    """The checkpoint's vocabulary size and how many ids at its top the workload leaves alone (special tokens)."""
    import json

    from kvscope.serve.driver import reserved_top_ids

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        vocab = int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"cannot read the vocabulary size from {model_dir}/config.json: {e}") from None
    eos = config.get("eos_token_id")
    eos_ids = frozenset(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    return vocab, reserved_top_ids(vocab, eos_ids)


def _max_prompt(args, model_dir: str) -> int:
    import json

    if args.max_model_len:
        return args.max_model_len - 1
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings", 2048)) - 1
    except (OSError, ValueError, TypeError):
        return 2047


class _Recorders:
    """`kvscope record` of each rank's watched stream, on threads, from before vLLM starts (so the first hello
    is caught); closed after vLLM says bye, or when it is gone without one: the file is readable either way."""

    def __init__(self, path: str, spec) -> None:
        from kvscope.traces.record import record

        self.stop = threading.Event()
        self.paths = [_rank_path(path, r, spec.dp_size) for r in range(spec.dp_size)]
        self.counts = [0] * spec.dp_size
        self.threads = []
        for r, (events, _, _) in enumerate(spec.rank_addresses()):
            def go(r=r, events=events):
                self.counts[r] = record(events, self.paths[r], stop=self.stop)

            t = threading.Thread(target=go, name=f"kvscope-record-{r}", daemon=True)
            t.start()
            self.threads.append(t)

    def close(self, wait_bye_s: float = 5.0) -> None:
        deadline = time.monotonic() + wait_bye_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10.0)
        for path, n in zip(self.paths, self.counts):
            if n:
                print(f"kvscope: recorded {n} events into {path}", file=sys.stderr)
            else:
                print(f"kvscope: nothing arrived from vLLM's scheduler; {path} not written", file=sys.stderr)


def _rank_path(path: str, rank: int, size: int) -> str:
    """FILE for one rank; run.kvtrace -> run.dp0.kvtrace, run.dp1.kvtrace ... for several."""
    if size == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.dp{rank}{ext or '.kvtrace'}"
