"""Python modules import in one direction: the graph of lily_py's imports has no cycle.

Every import statement counts, the ones inside functions too (a lazy import hides a circle at
load time, not in the design). ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module of the package, else to ``pkg`` itself (its ``__init__``). A package's implicit import of
its parents is not an edge (``lily_py.x`` needs ``lily_py`` imported first; that is no circle).
"""
from __future__ import annotations

import ast
import os

import pytest

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")
PACKAGE = "lily_py"


def modules() -> dict[str, tuple[str, bool]]:
    """{dotted module name: (path, is_package)} for every .py file and extension under lily_py."""
    out = {}
    root = os.path.join(SRC, PACKAGE)
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, SRC).replace(os.sep, ".")
        for f in files:
            if f == "__init__.py":
                out[rel] = (os.path.join(dirpath, f), True)
            elif f.endswith(".py"):
                out[f"{rel}.{f[:-3]}"] = (os.path.join(dirpath, f), False)
            elif f.endswith((".so", ".pyd")):
                out[f"{rel}.{f.split('.')[0]}"] = ("", False)   # compiled: imports nothing of ours
    # The C++ extension is built into the installed package, not into src/ (a clone has none).
    out.setdefault(f"{PACKAGE}._core", ("", False))
    return out


def import_edges(name: str, path: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of the package that ``name`` (at ``path``) imports, anywhere in its body."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    here = name if is_package else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            # `import lily_py.a.b` imports lily_py.a.b; keep the longest known prefix
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                edges.add(t)
    return edges


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: import_edges(m, p, pkg, known) if p else set() for m, (p, pkg) in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}           # 1: on the stack, 2: done
    for start in sorted(g):
        if start in state:
            continue
        stack = [(start, iter(sorted(g[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(g.get(nxt, ())))))
                path.append(nxt)
    return None


def test_the_checker_finds_a_planted_cycle_and_resolves_relative_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    p = tmp_path / "x.py"
    p.write_text("from . import engine, resolve\nfrom .spec import ROWS\n"
                 "def f():\n    from ..config import ModelConfig\n    import lily_py.model\n")
    known = {"lily_py", "lily_py.backends", "lily_py.backends.engine", "lily_py.backends.spec",
             "lily_py.backends.x", "lily_py.config", "lily_py.model"}
    # engine: a module; resolve: a name in the package's __init__; ROWS: a name in spec
    assert import_edges("lily_py.backends.x", str(p), False, known) == {
        "lily_py.backends.engine", "lily_py.backends", "lily_py.backends.spec", "lily_py.config",
        "lily_py.model"}


def test_the_graph_sees_the_package():
    g = graph()
    assert "lily_py.model" in g and "lily_py.backends.engine" in g and "lily_py._core" in g
    assert "lily_py.config" in g["lily_py.sizes"]


def test_lily_py_imports_in_one_direction():
    cycle = find_cycle(graph())
    if cycle is not None:
        pytest.fail("import cycle: " + " -> ".join(cycle))
