"""Every notebook in notebooks/ executes top to bottom (so they never rot).

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


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


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
    nb.cells.insert(0, new_code_cell(RESET))
    t0 = time.perf_counter()
    NotebookClient(nb, km=kernel, timeout=300, resources={"metadata": {"path": str(HERE)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
