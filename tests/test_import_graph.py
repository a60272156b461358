"""The import graph of llmmem: a DAG, no private name imported across top-level subpackages, every
module importable alone, and ``import llmmem`` without torch.

The graph is read from the source (ast), so it sees what a run might not: imports inside
functions count like module-level ones, ``from llmmem import X`` and ``llmmem.X`` count as
imports of the module ``llmmem.__init__`` resolves X to lazily (its ``_LAZY`` table), and a
string constant naming a module (``importlib.import_module("llmmem.x")``) counts as importing it.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys

import pytest
from support.procs import run_python

import llmmem

PKG = "llmmem"
ROOT = pathlib.Path(llmmem.__file__).resolve().parent


def _module_files() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PKG,) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _lazy_table() -> dict[str, str]:
    """llmmem.__init__'s ``_LAZY``: public name -> the module that defines it."""
    tree = ast.parse(MODULES[PKG].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("llmmem/__init__.py has no _LAZY table")


LAZY = _lazy_table()


def _top(module: str) -> str:
    """The top-level subpackage (or module) of ``module``: "amp" for llmmem.amp.kernels, "" for llmmem."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target_of_name(package: str, name: str) -> str:
    """The module ``from package import name`` depends on."""
    if f"{package}.{name}" in MODULES:
        return f"{package}.{name}"
    if package == PKG and name in LAZY:
        return LAZY[name]
    return package


def _graph() -> tuple[dict[str, set], list[str]]:
    """(module -> the llmmem modules it imports, private names imported across top-level subpackages)."""
    edges: dict[str, set] = {m: set() for m in MODULES}
    private = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = set()  # local names bound to the llmmem package by `import llmmem [as x]`
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        edges[module].add(a.name)
                        if a.name == PKG or a.asname is None:
                            aliases.add(a.asname or PKG)
                        _check_private_path(module, a.name, private)
            elif isinstance(node, ast.ImportFrom):
                package = _resolve_from(module, node)
                if package != PKG and not package.startswith(PKG + "."):
                    continue
                _check_private_path(module, package, private)
                for a in node.names:
                    edges[module].add(_target_of_name(package, a.name))
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        crosses = _top(package) != _top(module)
                        if package == PKG:  # the root's private names (its _C) are for top-level modules only
                            crosses = module.count(".") > 1
                        if crosses:
                            private.append(f"{module} imports {package}.{a.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
                if module != PKG:  # the root names every public module in _LAZY, resolved per name below
                    edges[module].add(node.value)
        for node in ast.walk(tree):  # llmmem.X after `import llmmem`: the module that X resolves to
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                edges[module].add(_target_of_name(PKG, node.attr))
    for module in edges:
        edges[module] = {t for t in edges[module] if t in MODULES and t != module}
    return edges, private


def _check_private_path(module: str, imported: str, private: list) -> None:
    """A private module below another top-level subpackage (llmmem.amp._x from llmmem.checkpointing)."""
    parts = imported.split(".")
    if _top(imported) != _top(module) and any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
        private.append(f"{module} imports {imported}")


def _cycles(edges: dict[str, set]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_graph_reader_sees_the_kinds_of_import_it_claims():
    edges, _ = _graph()
    assert "llmmem.amp.cpu_unscale" in edges["llmmem.amp.grad_scaler"]  # module level, `from pkg import mod`
    assert "llmmem.diagnostics.info" in edges["llmmem.__main__"]  # a string handed to import_module
    assert "llmmem.checkpointing.core" in edges["llmmem.checkpointing"]  # relative or absolute from-import
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_form_a_dag():
    edges, _ = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import cycles (break them by moving the shared piece down):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_private_name_is_imported_across_subpackages():
    _, private = _graph()
    assert not private, "make these public (or move them) instead:\n" + "\n".join(private)


DRIVER = r"""
import importlib, os, sys, traceback

def import_alone(module):
    '''Imports `module` in a forked child, so nothing of llmmem is imported before it.'''
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(module)
            msg = "ok torch" if "torch" in sys.modules else "ok"
        except BaseException:
            msg = "failed\n" + traceback.format_exc()
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    return msg or "died"

# torch-free modules first, while this process has not imported torch
for module in TORCH_FREE:
    print(module, import_alone(module).replace("\n", "\n    "), flush=True)
import torch  # once, shared by the forks below: each child pays only for its own module
for module in OTHERS:
    print(module, import_alone(module).replace("\n", "\n    "), flush=True)
"""

# What must work where torch is missing or broken: `import llmmem`, the error classes, the
# estimator of named models and its command line.
TORCH_FREE = [
    "llmmem",
    "llmmem.__main__",
    "llmmem._native",
    "llmmem.errors",
    "llmmem.units",
    "llmmem.estimation",
    "llmmem.estimation.cli",
    "llmmem.estimation.estimator",
    "llmmem.estimation.model_configs",
]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="imports each module in a forked child")
def test_every_module_imports_alone_and_the_torch_free_ones_without_torch():
    assert set(TORCH_FREE) <= set(MODULES)
    others = [m for m in MODULES if m not in TORCH_FREE]
    code = f"TORCH_FREE = {TORCH_FREE!r}\nOTHERS = {others!r}\n" + DRIVER
    proc = run_python(code, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if not line.startswith(" "))
    assert set(results) == set(MODULES), proc.stdout
    failed = {m: r for m, r in results.items() if not r.startswith("ok")}
    assert not failed, proc.stdout
    with_torch = [m for m in TORCH_FREE if results[m] != "ok"]
    assert not with_torch, f"these import torch: {with_torch}"


def test_import_llmmem_in_a_fresh_interpreter_imports_no_torch():
    proc = run_python(
        "import sys, llmmem; llmmem.LlmmemError; llmmem.parse_bytes('1GB'); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


if __name__ == "__main__":  # the graph, for a closing note: python tests/test_import_graph.py
    graph, _ = _graph()
    for m in sorted(graph):
        print(m, "->", ", ".join(sorted(graph[m])) or "-")
    sys.exit(0)
