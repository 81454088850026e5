"""The import graph of autoplan, cost_models and hyper_parallel has no cycles, and no function-local
import of the project's own modules hides one.

Cycles are found by the shared finder (``../shared/tools/import_cycles.py`` beside the repository,
where the CI clone has it; a copy of its algorithm below otherwise): one node per file, an edge per
``import`` or ``from ... import`` anywhere in the file -- function-local ones included, so moving an
import into a function does not hide a cycle from it.

A function-local ``from autoplan|cost_models|hyper_parallel ...`` import must carry a
``# lazy: <reason>`` comment on its line (a layer boundary, an optional heavy dependency behind
it, a CLI subcommand loaded on demand); an unexplained one is a failure, so every remaining one
is a decision somebody wrote down.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("autoplan", "cost_models", "hyper_parallel")
PROJECT = tuple(p + "." for p in PACKAGES) + PACKAGES
SHARED_FINDER = ROOT.parent / "shared" / "tools" / "import_cycles.py"


def _copied_finder():
    """The shared finder's algorithm (modules -> edges -> strongly connected components)."""

    def modules(pkgs):
        out = {}
        for pkg in pkgs:
            for root, _, files in os.walk(pkg):
                for f in files:
                    if f.endswith(".py"):
                        p = os.path.join(root, f)
                        name = p[:-3].replace(os.sep, ".")
                        if name.endswith(".__init__"):
                            name = name[: -len(".__init__")]
                        out[name] = p
        return out

    def edges(mods):
        g = {m: set() for m in mods}
        for m, p in mods.items():
            pkg = m if p.endswith("__init__.py") else m.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(open(p).read())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = pkg.split(".")
                        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                for n in names:
                    while n and n not in mods:
                        n = n.rsplit(".", 1)[0] if "." in n else ""
                    if n and n != m and not mods[n].endswith("__init__.py"):
                        g[m].add(n)
        return g

    def sccs(g):
        index, low, stack, on, out, i = {}, {}, [], set(), [], [0]

        def visit(v):
            index[v] = low[v] = i[0]
            i[0] += 1
            stack.append(v)
            on.add(v)
            for w in g[v]:
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        sys.setrecursionlimit(10000)
        for v in g:
            if v not in index:
                visit(v)
        return out

    return modules, edges, sccs


def _finder():
    if SHARED_FINDER.is_file():
        spec = importlib.util.spec_from_file_location("import_cycles", SHARED_FINDER)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.modules, mod.edges, mod.sccs
    return _copied_finder()


def cycles(root: Path = ROOT, packages=PACKAGES) -> list[list[str]]:
    modules, edges, sccs = _finder()
    cwd = os.getcwd()
    os.chdir(root)  # the finder names modules by path relative to the working directory
    try:
        return sccs(edges(modules([p for p in packages if os.path.isdir(p)])))
    finally:
        os.chdir(cwd)


def unexplained_local_imports(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """``path:line: text`` of every import of a project module inside a function body whose line
    has no ``# lazy: <reason>`` comment."""
    bad = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            src = path.read_text()
            lines = src.splitlines()
            tree = ast.parse(src)
            for fn in ast.walk(tree):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom):
                        names = [node.module or ""] if not node.level else ["."]  # relative: the project's
                    elif isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    else:
                        continue
                    if not any(n == "." or n.startswith(PROJECT) for n in names):
                        continue
                    text = lines[node.lineno - 1]
                    reason = text.split("# lazy:", 1)[1].strip() if "# lazy:" in text else ""
                    if not reason:
                        bad.append(f"{path.relative_to(root)}:{node.lineno}: {text.strip()}")
    return sorted(set(bad))  # a nested function's import is reached from each enclosing function


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles (break them by moving the shared concept, not by a local import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_function_local_project_imports_say_why():
    bad = unexplained_local_imports()
    assert not bad, ("function-local imports of project modules without a '# lazy: <reason>' comment "
                     "(move them to the top of the file; if that makes a cycle, move the shared concept):\n"
                     + "\n".join(bad))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checks_can_fail(tmp_path):
    """Both checks see what they are for: a cycle closed by a function-local import, and an
    unexplained local import next to an explained one."""
    _write(tmp_path, {
        "autoplan/__init__.py": "",
        "autoplan/a.py": "from autoplan.b import g\n\ndef f():\n    return g()\n",
        "autoplan/b.py": "def g():\n    from autoplan.a import f\n    return f\n\n"
                         "def h():\n    from autoplan.a import f  # lazy: a reason\n    return f\n",
    })
    assert cycles(tmp_path, ("autoplan",)) == [["autoplan.a", "autoplan.b"]]
    assert unexplained_local_imports(tmp_path, ("autoplan",)) == ["autoplan/b.py:2: from autoplan.a import f"]


@pytest.mark.skipif(not SHARED_FINDER.is_file(), reason="shared finder not beside the repository")
def test_copied_finder_equals_shared(tmp_path):
    """The fallback copy finds what the shared finder finds (on the repository and on a cycle)."""
    _write(tmp_path, {"autoplan/__init__.py": "", "autoplan/a.py": "import autoplan.b\n",
                      "autoplan/b.py": "def f():\n    from . import a\n"})
    shared, copied = _finder(), _copied_finder()
    for root, pkgs in ((ROOT, PACKAGES), (tmp_path, ("autoplan",))):
        cwd = os.getcwd()
        os.chdir(root)
        try:
            got = [sorted(map(sorted, fs[2](fs[1](fs[0](list(pkgs)))))) for fs in (shared, copied)]
        finally:
            os.chdir(cwd)
        assert got[0] == got[1]
