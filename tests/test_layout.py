"""The package's shape: heavy imports stay off the paths that do not need them, and no import cycles."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

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
