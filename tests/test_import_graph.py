"""The shape of the code, as tests: the import graph of autoplan, cost_models and hyper_parallel has
no cycles and no function-local import of the project's own modules; cost_models sits below
autoplan; no code cites an issue number; few internal functions take more than ten parameters;
``autoplan/search`` is a set of packages rather than a flat bag; ``docs/layout.md`` names every
module.

Cycles are found by the shared finder (``../shared/tools/import_cycles.py`` beside the repository,
where the CI clone has it; a copy of its algorithm below otherwise): one node per file, an edge per
``import`` or ``from ... import`` anywhere in the file -- function-local ones included, so moving an
import into a function does not hide a cycle from it.

A function-local ``from autoplan|cost_models|hyper_parallel ...`` import is a failure (one under
``if TYPE_CHECKING:`` is not inside a function and so is allowed): it hides a layering problem
that should be solved by moving the shared concept down, not by deferring the import.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
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


def package_cycles(root: Path = ROOT, packages=PACKAGES) -> list[list[str]]:
    """Cycles where a name taken from a package's ``__init__`` counts as an edge to it.

    The shared finder drops every edge into an ``__init__`` (each import of a submodule runs its
    package's ``__init__``, so counting those would tie everything together); but ``from
    autoplan.review import explain`` runs ``autoplan/review/__init__.py`` *for* a name it
    re-exports, and whatever that ``__init__`` imports is then part of the importer's world. Here
    ``from pkg import x`` is an edge to ``pkg.x`` when x is a submodule, else to ``pkg``."""
    modules, _, sccs = _finder()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        mods = modules([p for p in packages if os.path.isdir(p)])
        graph = {m: set() for m in mods}

        def known(name: str) -> str:
            while name and name not in mods:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            return name

        for m, path in mods.items():
            pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(Path(path).read_text())):
                if isinstance(node, ast.Import):
                    targets = [known(a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = pkg.split(".")
                        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base) for a in node.names]
                else:
                    continue
                graph[m].update(t for t in targets if t and t != m)
        return sccs(graph)
    finally:
        os.chdir(cwd)


def local_imports(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """``path:line: text`` of every import of a project module inside a function body."""
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
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(bad))  # a nested function's import is reached from each enclosing function


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles (break them by moving the shared concept, not by a local import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycles_through_package_faces():
    found = package_cycles()
    assert not found, "import cycles through a package's __init__:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_function_local_project_imports():
    bad = local_imports()
    assert not bad, ("function-local imports of project modules (move them to the top of the file; if that "
                     "makes a cycle, move the shared concept down a layer):\n" + "\n".join(bad))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checks_can_fail(tmp_path):
    """Both checks see what they are for: a cycle closed by a function-local import, and every
    function-local import (a comment does not excuse one)."""
    _write(tmp_path, {
        "autoplan/__init__.py": "",
        "autoplan/a.py": "from autoplan.b import g\n\ndef f():\n    return g()\n",
        "autoplan/b.py": "def g():\n    from autoplan.a import f\n    return f\n\n"
                         "def h():\n    from autoplan.a import f  # lazy: a reason\n    return f\n",
    })
    assert cycles(tmp_path, ("autoplan",)) == [["autoplan.a", "autoplan.b"]]
    assert local_imports(tmp_path, ("autoplan",)) == ["autoplan/b.py:2: from autoplan.a import f",
                                                       "autoplan/b.py:6: from autoplan.a import f  # lazy: a reason"]


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


# ---- layering, words and size ----------------------------------------------------------------------

def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, wherever it stands."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module or ""))
    return out


def test_cost_models_imports_nothing_from_autoplan():
    """cost_models prices hardware; autoplan builds on it. An import upwards ties the cost model to
    one planner's models and fixtures (they belong in autoplan)."""
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in sorted((ROOT / "cost_models").rglob("*.py"))
           for line, mod in imported_modules(p) if mod == "autoplan" or mod.startswith("autoplan.")]
    assert not bad, "cost_models imports autoplan:\n" + "\n".join(bad)


# an issue tracker's numbers mean nothing to a reader of the code: say what happened instead
ISSUE_NUMBER = re.compile(r"\bissues? ?#?\d+\b|(?<![&\w])#\d{2,}\b", re.IGNORECASE)
COLOUR = re.compile(r"#[0-9a-fA-F]{3}(?:[0-9a-fA-F]{3})?\b")   # CSS colours in report templates


def issue_citations(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    bad = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if ISSUE_NUMBER.search(COLOUR.sub("", line)):
                    bad.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    return bad


def test_no_issue_numbers_in_code():
    bad = issue_citations()
    assert not bad, "code cites issue numbers (say what the issue was instead):\n" + "\n".join(bad)


# public entry points keep friendly keywords; everything inside takes a PlanRequest or a record
PUBLIC_ENTRY_POINTS = {"autoplan/api.py:autoplan", "autoplan/cluster.py:plan_cluster",
                       "autoplan/hsdp.py:plan_hsdp", "autoplan/context_search.py:plan_context"}
MAX_LONG_SIGNATURES = 2


def long_signatures(root: Path = ROOT, packages=PACKAGES, limit: int = 10) -> list[str]:
    """``path:name (n)`` of every function (not a public entry point) with more than ``limit``
    parameters, self and cls not counted, ``*args`` / ``**kwargs`` one each."""
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or f"{rel}:{fn.name}" in PUBLIC_ENTRY_POINTS:
                    continue
                a = fn.args
                n = sum(x.arg not in ("self", "cls") for x in a.posonlyargs + a.args + a.kwonlyargs)
                n += bool(a.vararg) + bool(a.kwarg)
                if n > limit:
                    out.append(f"{rel}:{fn.name} ({n})")
    return out


def test_few_internal_functions_take_more_than_ten_parameters():
    found = long_signatures()
    assert len(found) <= MAX_LONG_SIGNATURES, (
        f"{len(found)} internal functions take more than 10 parameters (at most {MAX_LONG_SIGNATURES}); pass a "
        "PlanRequest or a record instead:\n" + "\n".join(found))


MAX_SEARCH_FILES = 12


def test_search_is_packages_not_a_flat_bag():
    """``autoplan/search`` holds one package per concern (tp, pipeline, mesh, experts, ...)."""
    files = sorted(p.name for p in (ROOT / "autoplan" / "search").iterdir() if p.is_file() and p.suffix == ".py")
    assert len(files) <= MAX_SEARCH_FILES, f"{len(files)} files directly in autoplan/search: {files}"


def project_modules(root: Path = ROOT, packages=PACKAGES) -> list[str]:
    """Every module of the project as a path relative to the repository (``autoplan/api.py``)."""
    return [p.relative_to(root).as_posix() for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]


def test_layout_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    missing = [m for m in project_modules() if f"`{m}`" not in text]
    assert not missing, (f"{len(missing)} modules missing from docs/layout.md (regenerate it: python "
                         "scripts/layout.py):\n" + "\n".join(missing))


def test_shape_checks_can_fail(tmp_path):
    """The checks above see what they are for, on a small tree made to break each."""
    _write(tmp_path, {
        "cost_models/a.py": "from autoplan.api import autoplan\n",
        "autoplan/b.py": "# priced as in issue 35\nCOLOUR = '#222'\n"
                         "def f(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n",
    })
    assert issue_citations(tmp_path, ("autoplan",)) == ["autoplan/b.py:1: # priced as in issue 35"]
    assert long_signatures(tmp_path, ("autoplan",)) == ["autoplan/b.py:f (11)"]
    assert imported_modules(tmp_path / "cost_models" / "a.py") == [(1, "autoplan.api")]
