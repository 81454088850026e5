"""Every notebook in notebooks/ executes top to bottom (so they never rot) and shows its figures.

A figure cell (tagged ``figure`` by notebooks/make_notebooks.py) must display an image: a
``<Figure size ...>`` text in its place is what a reader of a notebook saw when the plots
returned bare matplotlib Figures. The kernel runs with ``MPLBACKEND=Agg`` -- the backend of a
headless server, under which pyplot's inline integration never registers a Figure formatter --
so a figure shows only if it displays itself. The committed notebooks must hold their outputs
(make_notebooks.py executes them), figures included.

The kernel is the registered ``python3`` spec; PATH is pointed at this interpreter's bin folder
first so the kernel is the venv's Python, whichever Python runs pytest. One kernel runs all the
notebooks, one after another: starting a kernel and importing torch and autoplan in it cost about
as much as a notebook's own work on this 2-core machine. Each notebook starts with ``%reset -f``
(keeping the ``__dunder__`` names a fresh kernel has: multiprocessing's spawn reads
``__main__.__spec__``), so it sees an empty namespace (only imported modules are shared) and must
define everything it uses itself, as in a fresh kernel.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.util import run_sync
from nbformat.v4 import new_code_cell

HERE = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))
RESET = """def _fresh(ns=globals()):
    keep = {k: v for k, v in ns.items() if k.startswith('__') and k.endswith('__')}
    get_ipython().run_line_magic('reset', '-f')
    ns.update(keep)
_fresh()"""


FIGURE_TAG = "figure"
IMAGES = ("image/png", "image/svg+xml")


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


def _figure_problems(nb) -> list[str]:
    """Figure cells without an image, and any output that shows a Figure as text only."""
    problems = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        has_image = any(k in o.get("data", {}) for o in outputs for k in IMAGES)
        if FIGURE_TAG in cell.get("metadata", {}).get("tags", []) and not has_image:
            problems.append(f"{cell.get('id')}: figure cell shows no image: {cell.source[:60]!r}")
        for o in outputs:
            text = str(o.get("data", {}).get("text/plain", ""))
            if text.startswith("<Figure size") and not any(k in o["data"] for k in IMAGES):
                problems.append(f"{cell.get('id')}: a Figure displayed as text: {text!r}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_holds_its_outputs(path):
    """A reader of the repository sees tables and figures without running anything."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: not executed; run notebooks/make_notebooks.py"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not _figure_problems(nb), _figure_problems(nb)
    assert path.stat().st_size < 400_000, f"{path.name}: {path.stat().st_size} bytes"


@pytest.fixture(scope="module")
def kernel():
    """One python3 kernel for every notebook of this module, started in notebooks/."""
    with pytest.MonkeyPatch.context() as mp:  # the kernel's environment is fixed when it starts
        mp.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
        mp.setenv("MPLBACKEND", "Agg")
        km = AsyncKernelManager(kernel_name="python3")
        run_sync(km.start_kernel)(cwd=str(HERE))
    yield km
    run_sync(km.shutdown_kernel)(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel):
    if not run_sync(kernel.is_alive)():  # an earlier notebook killed it: start afresh
        run_sync(kernel.restart_kernel)(now=True)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:   # the committed outputs must not count: only what this run displays
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, new_code_cell(RESET))
    t0 = time.perf_counter()
    NotebookClient(nb, km=kernel, timeout=300, resources={"metadata": {"path": str(HERE)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    assert not _figure_problems(nb), _figure_problems(nb)
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
