"""No import cycles in llmserve, package inits included. Module A -> B for every import A makes when it is
imported (at its top level, in its class bodies, under its ifs and trys; not a function's lazy import).
`from pkg import sub` ties A to the package too (it names it, and its __init__ runs), where `import pkg.sub as S`
or `from pkg.sub import x` names only the submodule. A cycle found is printed with its modules."""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "llmserve")


def _modules() -> dict[str, str]:
    mods = {}
    base = os.path.dirname(os.path.abspath(ROOT))
    for d, _, files in os.walk(os.path.abspath(ROOT)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                mods[name] = path
    return mods


def _import_time(nodes):
    """The statements that run when the module is imported: not those inside functions (lazy imports)."""
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            yield from _import_time([child])


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in _import_time(ast.parse(open(path).read()).body):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out |= {f"{base}.{a.name}" for a in node.names} & mods.keys()
            if base in mods:
                out.add(base)
    out.discard(name)
    return out


def import_cycles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    mods = _modules()
    graph = {m: sorted(_imports(m, p, mods)) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def test_no_import_cycles_package_inits_included():
    assert import_cycles() == []


def test_the_check_finds_a_package_init_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "llmserve" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "llmserve" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from llmserve.p.a import A\n")
    (pkg / "a.py").write_text("from llmserve.p import b as B\nA = 1\n")
    (pkg / "b.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path / "llmserve"))
    assert import_cycles() == [["llmserve.p", "llmserve.p.a"]]
