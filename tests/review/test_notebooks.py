"""Every notebook in notebooks/ executes top to bottom (so they never rot).

The kernel is the registered ``python3`` spec; PATH is pointed at this interpreter's bin folder
first so the kernel is the venv's Python, whichever Python runs pytest.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
