"""Every command and snippet in README.md and docs/*.md runs as written.

Each ```sh / ```bash / ```python block is one test, named by its doc and line, and runs in
a fresh temporary directory (machinery and rules: tests/_docs.py). A block that cannot
run on a CPU box is marked in the doc source with ``<!-- doc-test: skip (reason) -->`` on
the line before it and shows as skipped with that reason (``pytest -rs`` lists them); its
flags are checked all the same. Every ``--flag`` a doc quotes for a kvscope command, in a
block or inline, must exist in that command's ``--help``.

The serve tests at the end run ``kvscope serve`` without ``--no-progress``, on a terminal
and without one, because the default path is the one a newcomer meets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _docs as D  # noqa: E402

BLOCKS = D.runnable_blocks()

# Flags the docs quote inline that belong to other tools, not to kvscope.
FOREIGN_FLAGS = {
    "--enable-prefix-caching": "vllm serve",
    "--kv-events-config": "vllm serve",
    "--enable-chunked-prefill": "vllm serve",
    "--long-prefill-token-threshold": "vllm serve",
    "--scheduler-cls": "vllm serve",
    "--enforce-eager": "vllm serve",
    "--data-parallel-size": "vllm serve",
    "--compilation-config": "vllm serve",
    "--num-gpu-blocks-override": "vllm serve",
    "--no-enable-prefix-caching": "vllm serve",
    "--no-enable-chunked-prefill": "vllm serve",
    "--scheduling-policy": "vllm serve",
    "--shutdown-timeout": "vllm serve",
    "--snapshot-update": "pytest-textual-snapshot",
    "--dry-run": "benchmarks/gpu_check.py",
    "--out": "benchmarks/gpu_check.py",
    "--budget-s": "benchmarks/gpu_check.py",
    "--sections": "benchmarks/gpu_check.py",
    "--static-requests": "benchmarks/gpu_check.py",
    "--generate-batch-s": "benchmarks/gpu_check.py",
}


def test_foreign_flags_of_repo_scripts_exist():
    """The flags quoted for this repo's own scripts are in their argument parsers."""
    for flag, tool in FOREIGN_FLAGS.items():
        if tool.endswith(".py"):
            with open(os.path.join(D.ROOT, tool), encoding="utf-8") as f:
                assert f'"{flag}"' in f.read(), f"{tool} has no {flag}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block_runs(block, tmp_path):
    if block.skip:
        pytest.skip(f"{block.id}: doc-test: skip ({block.skip})")
    D.run_block(block, str(tmp_path))


def test_every_command_block_has_a_runner_or_a_marker():
    """A block of commands in a language the harness does not run would be skipped silently."""
    bad = []
    for b in D.all_blocks():
        if b.lang in D.RUN_LANGS or b.skip:
            continue
        lines = [ln.strip() for ln in b.text.split("\n")]
        looks_like_commands = any(re.match(r"(\$ )?([A-Z_]+=\S+ )*(kvscope|python3?|make|curl) |\.venv/bin/", ln)
                                  for ln in lines)
        if b.lang in ("shell", "console", "zsh", "py", "python3") or (b.lang == "" and looks_like_commands):
            bad.append(f"{b.id} (```{b.lang})")
    assert not bad, "label these blocks sh or python, or mark them <!-- doc-test: skip (why) -->: " + ", ".join(bad)


def test_skip_markers_sit_on_runnable_blocks():
    """A marker on a block the harness would not run anyway is a leftover; each gives a reason."""
    for b in D.all_blocks():
        if b.skip is not None:
            assert b.lang in D.RUN_LANGS, f"{b.id}: a doc-test marker on a ```{b.lang} block"
            assert len(b.skip.strip()) >= 8, f"{b.id}: say why the block cannot run here"


# ----------------------------------------------------------------------------- flags
@pytest.fixture(scope="module")
def helps():
    top = D.help_texts([""])[""]
    cmds = D.subcommands(top)
    assert "serve" in cmds and "replay" in cmds, top
    texts = D.help_texts(cmds)
    return {c: D.help_flags(t) | {"--help"} for c, t in texts.items()}


def _invocation_problems(argv: list[str], helps: dict[str, set[str]]) -> list[str]:
    cmd = D.subcommand(argv)
    if cmd is None:
        return [f"`kvscope {' '.join(argv)}` names no command"]
    if cmd not in helps:
        return [f"`kvscope {cmd}` is no command (commands: {', '.join(sorted(helps))})"]
    known = set(helps[cmd])
    if cmd == "web":  # its own flags, then the served command's
        nested = next((a for a in argv[1:] if a in helps), None)
        if nested:
            known |= helps[nested]
    return [f"`kvscope {cmd}` has no {f}" for f in D.flags(argv[1:]) if f not in known]


@pytest.mark.parametrize("doc", D.DOCS)
def test_doc_flags_exist(doc, helps):
    problems = []
    for b in D.blocks(doc):
        if b.lang not in ("sh", "bash", "text"):
            continue
        for argv in D.kvscope_invocations(b.text, shell=b.lang != "text"):
            problems += [f"{b.id}: {p}" for p in _invocation_problems(argv, helps)]
    every_flag = set().union(*helps.values())
    for line, span in D.inline_spans(doc):
        parts = re.findall(r"\S+", span)
        if parts and parts[0] == "kvscope" and len(parts) > 1 and re.match(r"[a-z]", parts[1]):
            problems += [f"{doc}:{line}: {p}" for p in _invocation_problems(parts[1:], helps)]
        elif parts and parts[0] in helps and len(parts) > 1 and parts[1].startswith("--"):
            problems += [f"{doc}:{line}: {p}" for p in _invocation_problems(parts, helps)]
        elif parts and parts[0].startswith("--"):
            flag = D.flags(parts[:1])
            if flag and flag[0].endswith("-"):  # a family, as in `--vllm-...`
                if not any(f.startswith(flag[0]) for f in every_flag):
                    problems.append(f"{doc}:{line}: no kvscope flag starts {flag[0]}")
            elif flag and flag[0] not in every_flag and flag[0] not in FOREIGN_FLAGS:
                problems.append(f"{doc}:{line}: no kvscope command has {flag[0]}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- serve's default path
def _kvscope(*args: str) -> str:
    return " ".join(["kvscope", *args])


def _complete(port: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait_health(port: int, run: D.PtyRun) -> None:
    deadline = time.monotonic() + D.UP_TIMEOUT_S
    while not D._http_health("127.0.0.1", port):
        run.pump(0.3)
        assert run.status is None, f"serve exited {run.status}:\n{D._tail(run.text())}"
        assert time.monotonic() < deadline, f"serve did not come up:\n{D._tail(run.text())}"


def _ctrl_c(run: D.PtyRun) -> None:
    os.write(run.fd, b"\x03")  # Ctrl-C through the terminal, as a user stops it
    status = run.wait(D.STOP_TIMEOUT_S)
    assert status is not None, "serve did not stop on Ctrl-C"
    assert status in (0, 130, -2), f"serve exited {status} on Ctrl-C:\n{D._tail(run.text())}"
    assert "Traceback" not in run.text(), D._tail(run.text())


def test_serve_http_on_a_terminal_with_its_progress_bar(tmp_path):
    """The README's `kvscope serve --http 127.0.0.1:8000` (no --no-progress) on a terminal answers."""
    port = D.free_port()
    run = D.start_pty(_kvscope("serve", "--http", f"127.0.0.1:{port}"), str(tmp_path), D.environment())
    try:
        _wait_health(port, run)
        out = _complete(port)
        assert out["choices"] and out["usage"]["completion_tokens"] >= 1, out
        _ctrl_c(run)
    finally:
        run.kill()


def test_serve_forever_on_a_terminal_with_its_progress_bar(tmp_path):
    port = D.free_port()
    cmd = _kvscope("serve", "--workload", "demo", "--forever", "--events", f"tcp://127.0.0.1:{port}",
                   "--record", "t.kvtrace")
    run = D.start_pty(cmd, str(tmp_path), D.environment())
    try:
        deadline = time.monotonic() + D.UP_TIMEOUT_S
        trace = tmp_path / "t.kvtrace"
        # serving: its socket is bound, the trace is open and the bar has drawn (it loads the model first)
        while not (D._accepts("127.0.0.1", port) and trace.exists() and b"req" in run.output):
            run.pump(0.3)
            assert run.status is None, f"serve exited {run.status}:\n{D._tail(run.text())}"
            assert time.monotonic() < deadline, D._tail(run.text())
        run.pump(2.0)  # a few steps, a few progress-bar updates
        assert run.status is None, f"serve exited {run.status}:\n{D._tail(run.text())}"
        _ctrl_c(run)
    finally:
        run.kill()
    info = subprocess.run([sys.executable, "-m", "kvscope.cli", "trace-info", "t.kvtrace"], cwd=tmp_path,
                          env=D.environment(), capture_output=True, text=True, timeout=D.COMMAND_TIMEOUT_S)
    assert info.returncode == 0 and "warnings:   none" in info.stdout, info.stdout + info.stderr


def test_serve_forever_without_a_terminal_with_its_progress_bar(tmp_path):
    port = D.free_port()
    cmd = _kvscope("serve", "--workload", "demo", "--forever", "--events", f"tcp://127.0.0.1:{port}")
    d = D.start_daemon(cmd, D.words(cmd)[1:], str(tmp_path), D.environment())
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert d.proc.poll() is None, f"serve exited {d.proc.returncode}:\n{D._tail(d.output())}"
            time.sleep(0.2)
    finally:
        D.stop_daemon(d)


def test_finite_serve_on_a_terminal_draws_its_progress_bar_and_ends(tmp_path):
    run = D.start_pty(_kvscope("serve", "--workload", "chat", "--num-requests", "4"), str(tmp_path),
                      D.environment())
    try:
        status = run.wait(D.COMMAND_TIMEOUT_S)
        assert status == 0, f"serve exited {status}:\n{D._tail(run.text())}"
        assert "4/4" in run.text(), D._tail(run.text())  # the bar reached its total
    finally:
        run.kill()
