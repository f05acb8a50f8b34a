"""The package's shape: its layers as docs/ARCHITECTURE.md draws them, heavy imports kept off the paths that do
not need them, one path for KvscopeError, and no import cycles."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers")


def _run_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _loaded_heavy(code: str) -> list[str]:
    """Run code in a fresh interpreter; return which heavy modules it imported."""
    out = _run_python(code + f"\nimport sys\nprint('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n")
    (line,) = [x for x in out.splitlines() if x.startswith("HEAVY=")]
    return [m for m in line.removeprefix("HEAVY=").split(",") if m]


def test_a_sim_run_imports_no_torch():
    heavy = _loaded_heavy(
        "from kvscope.engine import EngineConfig, LLMEngine, SamplingParams\n"
        "e = LLMEngine(EngineConfig(backend='sim', model='qwen3-0.6b', gpu='l4', mode='chunked'))\n"
        "e.add_request(list(range(1, 300)), SamplingParams(max_tokens=8, ignore_eos=True))\n"
        "done = []\n"
        "while e.has_unfinished():\n"
        "    done += e.step()\n"
        "assert len(done) == 1 and len(done[0].output_token_ids) == 8\n"
        "assert isinstance(e.device, str) and e.device == 'sim:l4'\n"
        "assert e.hello().config.kv_cache_bytes == e.kv_cache_bytes > 0\n")
    assert heavy == []


def test_sim_serve_and_bench_commands_import_no_torch(tmp_path):
    heavy = _loaded_heavy(
        "from kvscope.cli import main\n"
        f"assert main(['serve', '--backend', 'sim', '--model', 'qwen3-0.6b', '--num-requests', '4', '--no-progress',"
        f" '--record', {str(tmp_path / 's.kvtrace')!r}]) == 0\n"
        "assert main(['bench', '--backend', 'sim', '--model', 'qwen3-0.6b', '--num-requests', '4',"
        " '--modes', 'chunked']) == 0\n")
    assert heavy == []


def test_replay_and_trace_info_import_no_torch():
    trace = os.path.join(ROOT, "traces", "demo-cpu.kvtrace")
    heavy = _loaded_heavy(
        "import asyncio\n"
        "from textual.app import App\n"
        "def headless(self, *a, **k):  # mount the real app once, headless, then leave\n"
        "    async def go():\n"
        "        async with self.run_test() as pilot:\n"
        "            await pilot.pause()\n"
        "    asyncio.run(go())\n"
        "App.run = headless\n"
        "from kvscope.cli import main\n"
        f"assert main(['trace-info', {trace!r}]) == 0\n"
        f"assert main(['replay', {trace!r}]) == 0\n")
    assert heavy == []


# ---- import cycles ---------------------------------------------------------------------------
def _modules() -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kvscope")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                found[name] = path
    return found


def _imports(tree: ast.AST, name: str, is_package: bool, modules: dict[str, str]) -> set[str]:
    """kvscope modules imported anywhere in the file (function-level too), except under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import sub` imports the submodule; other names come from pkg
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        graph[name] = _imports(tree, name, path.endswith("__init__.py"), modules)
    return graph


def test_no_import_cycles_inside_kvscope():
    """Function-level imports count too: a cycle hidden inside a function is still a cycle. No exceptions."""
    graph = _import_graph()
    assert graph["kvscope.engine.llm_engine"], "the walk found no imports at all"
    assert graph["kvscope.cli.main"], "the walk found no imports of the CLI"
    assert _cycles(graph) == []


def test_only_the_cli_imports_the_cli():
    graph = _import_graph()
    outside = [m for m, deps in graph.items() if not (m.startswith("kvscope.cli") or m == "kvscope.__main__")
               and any(d.startswith("kvscope.cli") for d in deps)]
    assert outside == []


def test_every_command_is_its_own_module():
    from kvscope.cli.main import COMMANDS

    modules = [type(c).__module__ for c in COMMANDS]
    assert len(set(modules)) == len(modules), modules
    assert all(m.startswith("kvscope.cli.") for m in modules)
    assert len({c.name for c in COMMANDS}) == len(COMMANDS)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- layers ----------------------------------------------------------------------------------
# Which kvscope packages each package may import (function-level imports included), docs/ARCHITECTURE.md's
# picture as a table. A module at kvscope's top (errors, quantiles, ...) counts as a package of its own.
BASE = {"kvscope.errors", "kvscope.quantiles", "kvscope.goodput", "kvscope.cpu_isa", "kvscope.openmp_wait"}
LAYERS = {
    "kvscope.errors": set(),
    "kvscope.quantiles": set(),
    "kvscope.goodput": {"kvscope.errors"},
    "kvscope.cpu_isa": set(),
    "kvscope.openmp_wait": set(),
    "kvscope.output_paths": BASE,
    "kvscope.child": BASE,
    "kvscope.protocol": BASE,
    "kvscope.traces": BASE | {"kvscope.protocol"},
    "kvscope.workload": BASE | {"kvscope.protocol"},
    "kvscope.kernels": BASE,
    "kvscope.engine": BASE | {"kvscope.protocol", "kvscope.kernels"},
    "kvscope.analysis": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.engine"},
    "kvscope.vllm": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.engine", "kvscope.analysis", "kvscope.child"},
    "kvscope.serve": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.workload", "kvscope.engine",
                             "kvscope.analysis", "kvscope.output_paths"},
    "kvscope.report": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.analysis", "kvscope.output_paths"},
    "kvscope.bench": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.workload", "kvscope.engine",
                             "kvscope.analysis", "kvscope.serve", "kvscope.vllm"},
    "kvscope.tui": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.engine", "kvscope.analysis",
                           "kvscope.vllm", "kvscope.child"},
    "kvscope.tour": BASE | {"kvscope.protocol", "kvscope.traces", "kvscope.engine", "kvscope.analysis", "kvscope.tui"},
    "kvscope.adapters": {"kvscope.vllm"},  # the dotted paths users type into vLLM, kept
}
# The engine's torch-free core: what the scheduler and the KV cache's bookkeeping may import.
CORE = ("kvscope.engine.sched", "kvscope.engine.kv")
CORE_MAY_IMPORT = BASE | {"kvscope.protocol", "kvscope.engine.sched", "kvscope.engine.kv", "kvscope.engine.config",
                          "kvscope.engine.request", "kvscope.engine.sampling_params"}


def _package(module: str, depth: int = 2) -> str:
    return ".".join(module.split(".")[:depth])


def _crossings(graph, allowed, owner) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        pkg = owner(mod)
        if pkg not in allowed:
            continue
        for dep in sorted(deps):
            target = next((t for t in allowed[pkg] | {pkg} if dep == t or dep.startswith(t + ".")), None)
            if target is None and dep != "kvscope":
                bad.append(f"{mod} imports {dep}")
    return bad


def test_packages_import_only_the_layers_below_them():
    graph = _import_graph()
    packages = {_package(m) for m in graph if m != "kvscope"} - {"kvscope.cli", "kvscope.__main__"}
    assert packages <= set(LAYERS), f"a package with no row in LAYERS: {sorted(packages - set(LAYERS))}"
    assert _crossings(graph, LAYERS, _package) == []


def test_the_scheduler_and_the_kv_bookkeeping_import_only_the_engine_core():
    graph = _import_graph()
    core = {m: d for m, d in graph.items() if m.startswith(CORE)}
    assert len(core) >= 8, sorted(core)  # sched and kv found
    owner = lambda m: "core"  # noqa: E731
    assert _crossings(core, {"core": CORE_MAY_IMPORT}, owner) == []


def test_the_scheduler_and_the_kv_bookkeeping_load_no_torch():
    graph = _import_graph()
    core = sorted(m for m in graph if m.startswith(CORE))
    assert _loaded_heavy("import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in core)) == []


def test_kvscope_error_has_one_import_path():
    """Every module takes KvscopeError from kvscope.errors (kvscope.engine re-exports it lazily, for users)."""
    found = []
    for name, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "KvscopeError" for a in node.names):
                if node.module != "kvscope.errors":
                    found.append(f"{name}: from {node.module} import KvscopeError")
    assert found == []


def test_the_layer_check_sees_a_crossing():
    graph = {"kvscope.engine.llm_engine": {"kvscope.vllm.inproc.scheduler", "kvscope.protocol.events"}}
    assert _crossings(graph, LAYERS, _package) == ["kvscope.engine.llm_engine imports kvscope.vllm.inproc.scheduler"]


def test_the_dotted_paths_users_type_into_vllm_still_resolve():
    """``--scheduler-cls kvscope.adapters.vllm_watch.WatchedScheduler`` and the plugin's old entry point."""
    pytest.importorskip("vllm")
    from kvscope.adapters import vllm_plugin, vllm_watch
    from kvscope.vllm.inproc import plugin, watched

    assert vllm_watch.WatchedScheduler is watched.WatchedScheduler
    assert vllm_plugin.KvscopeStatLogger is plugin.KvscopeStatLogger
