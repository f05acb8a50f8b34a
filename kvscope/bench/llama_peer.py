"""llama.cpp as a peer (`kvscope bench --peers llama-cpp`): the same requests through llama-cpp-python on
the same GGUF file, at the same thread count, served the way its Python API serves them: one at a time.

It is an optional extra (`pip install 'kvscope[llama]'`), not a dependency; the wheel builds from source,
natively for the CPU it builds on by default (about 4 minutes of 2 cores). That build ran on an AMD EPYC
with AVX-512; on the project's earlier AVX2-only machines it crashed with a segfault, and this one ran:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF" pip install llama-cpp-python

Greedy (top_k=1), EOS ignored so every request runs to its max_tokens, as kvscope's rows do. TTFT is
from the start of the run (every request arrives at t=0, so it includes the queue, as kvscope's TTFT
does); ITL is the gap between a request's successive tokens.

It runs in a child process (`python -m kvscope.bench.llama_peer`, requests as JSON on stdin, its times as
JSON on stdout) under the user's own environment, not the OpenMP wait kvscope chose for itself
(kvscope/openmp_wait.py): OpenMP reads it once per process, and llama.cpp, which meets its threads at a
barrier after every op, decoded SmolLM2 3x slower in kvscope's process under its earlier passive wait
(37 ms a token against 13).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from kvscope.bench.harness import Row
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError

INSTALL = ("pip install llama-cpp-python (built for this CPU, about 4 minutes of 2 cores; if that build "
           'segfaults, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF")')
NAME = "llama-cpp"


def gguf_path(config: EngineConfig) -> str:
    """The GGUF file both engines load: --model when it is one (or a named model's cached GGUF)."""
    path = config.model
    if not path.endswith(".gguf"):
        resolved = _named_gguf(path)
        if resolved is None:
            raise KvscopeError(f"peer {NAME} runs a GGUF file: pass --model PATH.gguf (kvscope loads the same file), "
                               f"not {path!r}")
        path = resolved
    if not os.path.isfile(path):
        raise KvscopeError(f"peer {NAME}: no GGUF file at {path}")
    return path


def _named_gguf(name: str) -> str | None:
    """A named real model's GGUF (e.g. smollm2-135m): its cached file, fetched the first time."""
    from kvscope.engine.loader import named_models
    return named_models.fetch(name) if name in named_models.NAMED_MODELS else None


def load_llama(path: str, threads: int, n_ctx: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        raise KvscopeError(f"peer {NAME} needs llama-cpp-python: {INSTALL}") from None
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                 verbose=False, seed=0)


def _exit_status(code: int) -> str:
    """A child's exit in words: a negative code is the signal that killed it."""
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGILL":
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        return ("killed by SIGILL (an illegal instruction): llama-cpp-python runs instructions this CPU does not "
                "(a build for another CPU, or AMX tiles in a VM that faults on them); rebuild it here, without AMX "
                f"where the CPU has it: CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{no_amx}' "
                f"-DCMAKE_CXX_FLAGS='{no_amx}'\" pip install --no-cache-dir --force-reinstall llama-cpp-python "
                "(docs/BENCHMARKS.md)")
    return f"killed by {name}"


def check_available() -> None:
    """Before minutes are spent on the other rows."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise KvscopeError(f"peer {NAME} needs llama-cpp-python: {INSTALL}") from None


def llama_cpp_row(config: EngineConfig, items, threads: int, sixteen_bit: str | None = None) -> Row:
    """One request at a time through Llama.generate (its Python API has one sequence). sixteen_bit ("bf16",
    "f16"): on that copy of the GGUF (gguf16.py: the dequantized weights kvscope runs), not the file itself."""
    from kvscope.bench.gguf16 import sixteen_bit_copy, weight_bytes_per_token

    path = gguf_path(config)
    if sixteen_bit is not None:
        path = sixteen_bit_copy(path, sixteen_bit)
    n_ctx = max(len(it.prompt) + it.max_tokens for it in items) + 8
    job = {"path": path, "threads": threads, "n_ctx": n_ctx,
           "requests": [[list(it.prompt), it.max_tokens] for it in items]}
    from kvscope.openmp_wait import user_environment

    proc = subprocess.run([sys.executable, "-m", "kvscope.bench.llama_peer"], input=json.dumps(job), text=True,
                          capture_output=True, env=user_environment())
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [_exit_status(proc.returncode)])[-1]
        raise KvscopeError(f"peer {NAME} failed on {os.path.basename(path)}: {last}")
    out = json.loads(proc.stdout)
    return Row.from_samples(f"{NAME}-{sixteen_bit}" if sixteen_bit else NAME, out["ttft"], out["itl"], out["tokens"],
                            out["span"], threads=threads, gguf=os.path.basename(path),
                            weights_mb_per_token=weight_bytes_per_token(path) / 1e6)


def serve_all(llm, requests: list[tuple[list[int], int]]) -> dict:
    """In the child: every request one at a time, after a warm-up; TTFT from the start of the run."""
    _serve_one(llm, [1, 2, 3], 2)  # warm-up, as kvscope's rows get one
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for prompt, max_tokens in requests:
        times = _serve_one(llm, prompt, max_tokens)
        ttft.append(times[0] - start)
        itl.extend(b - a for a, b in zip(times, times[1:]))
        tokens += len(times)
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "span": time.perf_counter() - start}


def _serve_one(llm, prompt: list[int], max_tokens: int) -> list[float]:
    """Greedy tokens for one prompt, EOS ignored; the time each token came out."""
    llm.reset()  # no prefix reuse from the previous request: every request computes its whole prompt
    times = []
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        if len(times) >= max_tokens:
            break
    return times


def _child() -> int:
    job = json.loads(sys.stdin.read())
    llm = load_llama(job["path"], int(job["threads"]), int(job["n_ctx"]))
    json.dump(serve_all(llm, [(list(p), int(n)) for p, n in job["requests"]]), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
