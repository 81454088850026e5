"""Library code, benchmarks, scripts and notebooks do not import ``hyper_parallel.testing``: what they
need to run locally lives in ``hyper_parallel.local``, and ``testing`` keeps only test helpers (no
re-exports of the moved names, so there is one place for each)."""
import ast
import json
from pathlib import Path

import hyper_parallel.local
import hyper_parallel.testing

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", ".venv", ".git", "build", "dist"}


def _imports_testing(source: str) -> list[int]:
    """Line numbers of every import of hyper_parallel.testing (module-level or local)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == "hyper_parallel.testing" or n.startswith("hyper_parallel.testing.") for n in names):
            lines.append(node.lineno)
    return lines


def _sources():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.parts[:2] == ("hyper_parallel", "testing") or not path.is_file():
            continue
        if path.suffix == ".py":
            yield rel.as_posix(), path.read_text()
        elif path.suffix == ".ipynb":
            cells = json.loads(path.read_text()).get("cells", [])
            code = "\n".join("".join(c.get("source", [])) for c in cells if c.get("cell_type") == "code")
            # notebook magics are not Python
            yield rel.as_posix(), "\n".join(ln for ln in code.splitlines() if not ln.lstrip().startswith(("%", "!")))


def test_nothing_outside_tests_imports_hyper_parallel_testing():
    hits = [f"{rel}:{n}" for rel, src in _sources() for n in _imports_testing(src)]
    assert not hits, "import these from hyper_parallel.local instead: " + ", ".join(hits)


def test_the_check_can_fail():
    assert _imports_testing("from hyper_parallel.testing import RankPool") == [1]
    assert _imports_testing("def f():\n    import hyper_parallel.testing.compare") == [2]
    assert _imports_testing("from hyper_parallel.local import RankPool") == []


def test_moved_names_live_in_one_place():
    moved = ["RankPool", "free_port", "fake_world", "cached_mesh", "CollectiveRecorder", "full", "grads_by_name",
             "kind_of"]
    assert all(hasattr(hyper_parallel.local, n) for n in moved)
    assert not [n for n in moved if n in hyper_parallel.testing.__all__ or hasattr(hyper_parallel.testing, n)]
