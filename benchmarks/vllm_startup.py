"""How long a vLLM start takes (`kvscope serve --engine vllm`), by vLLM's compilation choice, warm and cold.

    python benchmarks/vllm_startup.py --runs 2 --json benchmarks/results/vllm-startup-cpu-xeon.json

Each run starts vLLM's OpenAI server exactly as `kvscope serve --engine vllm --model smollm2-135m` does
(kvscope.vllm.launch.server: the watched scheduler, KV events, the 4 GiB CPU KV cache), times the
launch to the first 200 from /health, times one greedy request of 32 tokens after it (the first request's
cost, and its decode speed), and stops the server. Configurations alternate run by run:
- `compiled`: vLLM's default on this CPU (torch.compile, its cache in ~/.cache/vllm reused);
- `cold`: the same with an empty compile cache (VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR pointed at
  fresh folders, so the user's own caches are neither used nor touched): a first start on a new machine;
- `eager`: `--enforce-eager`;
- `mode0`: `--compilation-config '{"mode": 0}'` (no torch.compile);
- `noaot`: compiled, with VLLM_USE_AOT_COMPILE=0 (vLLM's older compile cache instead of its AOT artifacts, which
  vLLM 0.32's CPU build fails to load: "Compiling model again due to a load failure ... 'function' object has
  no attribute 'finalize_loading'"). Its first run fills that cache, the next ones read it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvscope.vllm.launch import flags as vf  # noqa: E402
from kvscope.vllm.launch import server as vs  # noqa: E402
from kvscope.vllm.launch.client import CompletionsClient  # noqa: E402

CONFIGS = {"compiled": (), "cold": (), "eager": ("--enforce-eager",),
           "mode0": ("--compilation-config", '{"mode": 0}'), "noaot": ()}


def one_start(name: str, model_dir: str, port: int, events_port: int) -> dict:
    extra_env = {}
    tmp = None
    if name == "noaot":
        extra_env = {"VLLM_USE_AOT_COMPILE": "0"}
    if name == "cold":
        tmp = tempfile.mkdtemp(prefix="kvscope-vllm-cold-")
        extra_env = {"VLLM_CACHE_ROOT": os.path.join(tmp, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")}
    spec = vs.LaunchSpec(python=vf.vllm_python(), model_dir=model_dir, served_model_name="smollm2-135m",
                         host="127.0.0.1", port=port, events_addr=f"tcp://127.0.0.1:{events_port}",
                         kv_events_addr=f"tcp://127.0.0.1:{events_port + 2}",
                         kv_replay_addr=f"tcp://127.0.0.1:{events_port + 3}", dtype="float32",
                         vllm_args=CONFIGS[name], kv_cache_gib=4, extra_env=extra_env)
    server = vs.VllmServer(spec)
    try:
        server.start()
        server.wait_ready()
        ready_s = time.monotonic() - server.started_at
        client = CompletionsClient("127.0.0.1", port, "smollm2-135m")
        c = client.complete(list(range(100, 164)), 32)
        first = {"ttft_s": c.ttft, "itl_mean_s": sum(c.itl) / len(c.itl)}
        c = client.complete(list(range(200, 264)), 32)
        second = {"ttft_s": c.ttft, "itl_mean_s": sum(c.itl) / len(c.itl)}
    finally:
        server.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"config": name, "ready_s": ready_s, "first_request": first, "second_request": second,
            "log": server.log_path}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--configs", default="compiled,eager,mode0,cold")
    p.add_argument("--port", type=int, default=8210)
    p.add_argument("--events-port", type=int, default=5610)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model_dir = vf.checkpoint("smollm2-135m", "float32")
    names = args.configs.split(",")
    order = [n for _ in range(args.runs) for n in names]
    runs = []
    for name in order:
        load = os.getloadavg()[0]
        r = one_start(name, model_dir, args.port, args.events_port)
        r["load_before"] = load
        runs.append(r)
        print(f"{name:9s} ready {r['ready_s']:6.1f} s  first request TTFT {r['first_request']['ttft_s']:.2f} s "
              f"ITL {r['first_request']['itl_mean_s'] * 1e3:.1f} ms  second TTFT {r['second_request']['ttft_s']:.3f} s "
              f"ITL {r['second_request']['itl_mean_s'] * 1e3:.1f} ms  (load {load:.1f})", flush=True)
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
