"""The package layering of jaxrl (jaxrl.LAYERS, bottom to top), checked on the import graph read from the source.

Every `import` / `from ... import` of every module counts, at module top and inside functions, and so does a
string literal naming a jaxrl module ("jaxrl.algorithms.dpo" or "jaxrl.algorithms.dpo:LOSSES": what a lazy
registry or `importlib.import_module` resolves later). The checks:

* a package imports only packages below it (`jaxrl.demo`, a top-level module, may import anything);
* no two modules import each other, directly or around a loop;
* no module imports another module's private name (`from m import _x`, or `m._x` on an imported module);
* imports inside functions are only for optional heavy dependencies (torch, vllm, matplotlib, ...).

The checker itself is tested on small synthetic package trees: an upward import, a cycle, a private import and a
function-level import of a library module must each be reported, and a clean tree must pass.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest

import jaxrl

ROOT = Path(__file__).resolve().parent.parent

# Third-party packages that may be imported inside a function: optional, or heavy and needed by one path only.
OPTIONAL = {"torch", "vllm", "matplotlib", "tensorboardX", "transformers", "tokenizers", "datasets",
            "reasoning_gym"}  # reasoning_gym: the [tasks] extra, imported where a task is generated or scored
# (importing module, imported module): why the import stays inside a function.
FUNCTION_LEVEL_OK: dict = {}
# Modules whose function-level imports of the standard library are deliberate.
STDLIB_INSIDE_OK = {"jaxrl.rewards._sandbox_server": "runs as PID 1 of the sandbox; imports after set-up",
                    "jaxrl.rewards.sandbox": "site: only for the opt-in site-packages bind"}
# Cycles allowed for now: frozensets of the modules involved, with the reason.
CYCLES_OK: dict = {}
# (importing module, imported module, name): private names still imported across modules, with the reason.
PRIVATE_OK: dict = {}


@dataclasses.dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    lineno: int
    how: str  # "top" | "function" | "string"


@dataclasses.dataclass
class Graph:
    modules: set
    packages: set  # the sub-packages of the root package (folders with an __init__.py)
    edges: list
    function_imports: list  # (module, imported name, lineno) of every import inside a function
    private: list  # (module, from module, name, lineno)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _docstrings(tree: ast.AST) -> set:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def build_graph(root: Path, package: str = "jaxrl") -> Graph:
    """The import graph of every module under `root/package` (see the module docstring)."""
    files = sorted((root / package).rglob("*.py"))
    modules = {_module_name(f, root) for f in files}
    packages = {p.parent.name for p in (root / package).glob("*/__init__.py")}
    graph = Graph(modules, packages, [], [], [])
    for path in files:
        name = _module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        docstrings = _docstrings(tree)
        imported_modules = {}  # local name -> jaxrl module it is bound to (for `m._x` checks)

        def visit(node, in_function: bool):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function = True
            if isinstance(node, ast.Import):
                for alias in node.names:
                    record(node, alias.name, in_function)
                    if alias.name in modules:
                        imported_modules[alias.asname or alias.name.split(".")[0]] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else base
                    record(node, target, in_function)
                    if full in modules:
                        imported_modules[alias.asname or alias.name] = full
                    elif _is_private(alias.name) and base.split(".")[0] == package:
                        graph.private.append((name, base, alias.name, node.lineno))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                target = node.value.split(":", 1)[0]
                if target in modules and target != name:
                    graph.edges.append(Edge(name, target, node.lineno, "string"))
            elif (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                  and node.value.id in imported_modules):
                graph.private.append((name, imported_modules[node.value.id], node.attr, node.lineno))
            for child in ast.iter_child_nodes(node):
                visit(child, in_function)

        def record(node, target: str, in_function: bool):
            if in_function:
                graph.function_imports.append((name, target, node.lineno))
            if target.split(".")[0] == package and target != name:
                graph.edges.append(Edge(name, target, node.lineno, "function" if in_function else "top"))

        visit(tree, False)
    return graph


def layer_of(module: str, graph: Graph, layers) -> int:
    """Position of the module's package in `layers`: -1 for the root package itself, len(layers) (above every
    layer) for a module directly under the root (jaxrl.demo); KeyError for a package not in `layers`."""
    parts = module.split(".")
    if len(parts) < 2:
        return -1
    if parts[1] not in graph.packages:
        return len(layers)
    if parts[1] not in layers:
        raise KeyError(parts[1])
    return layers.index(parts[1])


def layer_violations(graph: Graph, layers) -> list[str]:
    out = []
    for e in graph.edges:
        try:
            a, b = layer_of(e.src, graph, layers), layer_of(e.dst, graph, layers)
        except KeyError as unknown:
            out.append(f"{e.src}:{e.lineno} -> {e.dst}: package {unknown.args[0]!r} is not in LAYERS")
            continue
        if b > a:
            out.append(f"{e.src}:{e.lineno} imports {e.dst} ({e.how}): {e.src.split('.')[1]} is below "
                       f"{e.dst.split('.')[1]}")
    return out


def cycles(graph: Graph) -> list[frozenset]:
    """Strongly connected components of more than one module (Tarjan)."""
    succ = {}
    for e in graph.edges:
        if e.dst in graph.modules:
            succ.setdefault(e.src, set()).add(e.dst)
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph.modules):
        if v not in index:
            strong(v)
    return out


def function_import_violations(graph: Graph, package: str = "jaxrl") -> list[str]:
    out = []
    for module, target, lineno in graph.function_imports:
        top = target.split(".")[0]
        if top in OPTIONAL or (module, target) in FUNCTION_LEVEL_OK:
            continue
        if top in sys.stdlib_module_names and module in STDLIB_INSIDE_OK:
            continue
        out.append(f"{module}:{lineno} imports {target} inside a function (hoist it to the module top; only "
                   f"optional heavy dependencies {sorted(OPTIONAL)} stay inside)")
    return out


def private_violations(graph: Graph) -> list[str]:
    return [f"{m}:{lineno} uses the private name {name!r} of {src}" for m, src, name, lineno in graph.private
            if (m, src, name) not in PRIVATE_OK]


# ------------------------------------------------------------------------------------------------ the real tree


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph(ROOT)


def test_every_package_is_in_the_layer_order(graph):
    assert sorted(graph.packages) == sorted(jaxrl.LAYERS)
    assert "jaxrl.demo" in graph.modules  # the one top-level module, above every layer


def test_packages_import_only_downward(graph):
    assert len(graph.edges) > 300  # the graph is really read
    lazy = {(e.src, e.dst) for e in graph.edges if e.how == "string"}
    assert ("jaxrl.algorithms.tasks", "jaxrl.algorithms.dpo_task") in lazy  # registries resolved by name count too
    assert layer_violations(graph, jaxrl.LAYERS) == []


def test_no_module_cycles(graph):
    found = [c for c in cycles(graph) if c not in CYCLES_OK]
    assert found == [], [sorted(c) for c in found]


def test_no_private_names_across_modules(graph):
    assert private_violations(graph) == []


def test_function_level_imports_are_optional_dependencies_only(graph):
    assert function_import_violations(graph) == []


# ------------------------------------------------------------------------------------------------ the checker


def _tree(tmp_path: Path, files: dict) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in {p.parent for p in tmp_path.rglob("*.py")}:
        (directory / "__init__.py").touch()
    return tmp_path


LAYERS = ("utils", "models", "train")


def test_the_checker_passes_a_tree_that_imports_downward(tmp_path):
    root = _tree(tmp_path, {
        "jaxrl/utils/io.py": "import json\n",
        "jaxrl/models/lora.py": "from jaxrl.utils import io\nfrom jaxrl.utils.io import json\n",
        "jaxrl/train/loop.py": "from ..models.lora import io\n\ndef f():\n    import torch\n",
        "jaxrl/demo.py": "from jaxrl.train import loop\n",
    })
    g = build_graph(root)
    assert {(e.src, e.dst) for e in g.edges} == {("jaxrl.models.lora", "jaxrl.utils.io"),
                                                 ("jaxrl.train.loop", "jaxrl.models.lora"),
                                                 ("jaxrl.demo", "jaxrl.train.loop")}
    assert layer_violations(g, LAYERS) == [] and cycles(g) == [] and private_violations(g) == []
    assert function_import_violations(g) == []


@pytest.mark.parametrize("source,how", [
    ("from jaxrl.train.loop import Trainer\n", "top"),
    ("import jaxrl.train.loop\n", "top"),
    ("def helper():\n    from jaxrl.train import loop\n    return loop\n", "function"),
    ("import importlib\nLOOP = importlib.import_module('jaxrl.train.loop')\n", "string"),
    ("HOME = 'jaxrl.train.loop:Trainer'\n", "string"),
])
def test_the_checker_fails_on_an_upward_import(tmp_path, source, how):
    root = _tree(tmp_path, {"jaxrl/utils/io.py": source, "jaxrl/train/loop.py": "class Trainer: ...\n"})
    found = layer_violations(build_graph(root), LAYERS)
    assert len(found) == 1 and "jaxrl.utils.io:" in found[0] and "jaxrl.train.loop" in found[0], found
    assert f"({how})" in found[0] and "utils is below train" in found[0]


def test_the_checker_finds_cycles_private_names_and_function_level_imports(tmp_path):
    root = _tree(tmp_path, {
        "jaxrl/models/a.py": "from jaxrl.models import b\nfrom jaxrl.utils.io import _helper\n",
        "jaxrl/models/b.py": "def f():\n    from jaxrl.models import a\n    return a\n",
        "jaxrl/models/c.py": "from jaxrl.utils import io\nX = io._helper\n",
        "jaxrl/utils/io.py": "def _helper(): ...\n",
        "jaxrl/train/loop.py": "def f():\n    import numpy\n",
    })
    g = build_graph(root)
    assert cycles(g) == [frozenset({"jaxrl.models.a", "jaxrl.models.b"})]
    assert sorted(private_violations(g)) == [
        "jaxrl.models.a:2 uses the private name '_helper' of jaxrl.utils.io",
        "jaxrl.models.c:2 uses the private name '_helper' of jaxrl.utils.io"]
    found = function_import_violations(g)
    assert len(found) == 2 and any("jaxrl.models.b:2 imports jaxrl.models.a" in f for f in found)
    assert any("jaxrl.train.loop:2 imports numpy" in f for f in found)


def test_a_package_missing_from_the_order_is_reported(tmp_path):
    root = _tree(tmp_path, {"jaxrl/utils/io.py": "from jaxrl.extras import thing\n",
                            "jaxrl/extras/thing.py": "X = 1\n"})
    found = layer_violations(build_graph(root), LAYERS)
    assert found == ["jaxrl.utils.io:1 -> jaxrl.extras.thing: package 'extras' is not in LAYERS"], found

