"""Nothing in the code unpickles without a guard: a new ``pickle.load`` or ``torch.load`` without
``weights_only=True``, or a DCP read through torch's own file reader, fails this test.

A checkpoint or any other file from elsewhere is data; unpickling runs the code a pickle names. So
in autoplan/, hyper_parallel/, cost_models/ and benchmarks/ every call that unpickles must be one
of: ``torch.load(..., weights_only=True)`` (torch's allowlisting unpickler), or code in
autoplan/train/safe_load.py (the restricted unpickler of DCP metadata, DCP's reader and planner
made data-only). DCP's ``FileSystemReader`` and default planner unpickle with plain ``pickle`` and
``torch.load(weights_only=False)``, so ``dcp.load`` from a directory is reserved to safe_load.py
too; a ``dcp.load`` with a storage reader of another kind (safetensors) holds no pickle. The scan
reads the source (``ast``), resolving import aliases (``import pickle as p``, ``from torch import
load``), so renaming does not hide a call.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("autoplan", "hyper_parallel", "cost_models", "benchmarks")
GUARDED = "autoplan/train/safe_load.py"
# Existing reads that are not of files from elsewhere, each with the reason it may stay.
ALLOWED = {
    ("autoplan/capture/graph_cache.py", "pickle.loads"):
        "the planner's own disk cache under the user's cache directory, written by this code in the same "
        "user's processes and versioned by a hash of the source (autoplan/disk_cache.py): as trusted as the "
        "installed code itself",
}
UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
              "marshal.load", "marshal.loads", "shelve.open", "dill.load", "dill.loads", "cloudpickle.load",
              "cloudpickle.loads", "joblib.load", "pandas.read_pickle",
              "torch.serialization.add_safe_globals", "torch.serialization.safe_globals"}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
DCP = "torch.distributed.checkpoint"
DCP_READERS = {f"{DCP}.FileSystemReader", f"{DCP}.filesystem.FileSystemReader", f"{DCP}.DefaultLoadPlanner",
               f"{DCP}.default_planner.DefaultLoadPlanner", f"{DCP}.format_utils.dcp_to_torch_save",
               f"{DCP}.format_utils.BroadcastingTorchSaveReader", f"{DCP}.state_dict_loader._load_state_dict"}
DCP_LOADS = {f"{DCP}.load", f"{DCP}.load_state_dict", f"{DCP}.state_dict_loader.load",
             f"{DCP}.state_dict_loader.load_state_dict"}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _weights_only(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def _other_reader(call: ast.Call, aliases: dict[str, str]) -> bool:
    """A dcp.load given a storage reader that is not DCP's file reader (e.g. safetensors)."""
    for k in call.keywords:
        if k.arg == "storage_reader":
            made = _dotted(k.value.func, aliases) if isinstance(k.value, ast.Call) else None
            return made is not None and made not in DCP_READERS
    return False


def unguarded(source: str, rel: str = "<snippet>") -> list[str]:
    """``file:line: what`` for every unguarded unpickling call (or Unpickler subclass) in ``source``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            targets = [name]
        elif isinstance(node, ast.ClassDef):
            targets = [_dotted(b, aliases) for b in node.bases]
        else:
            continue
        for name in filter(None, targets):
            bad = None
            if name in TORCH_LOADS and not (isinstance(node, ast.Call) and _weights_only(node)):
                bad = f"{name} without weights_only=True"
            elif name in UNPICKLERS or name in DCP_READERS:
                bad = name
            elif name in DCP_LOADS and not (isinstance(node, ast.Call) and _other_reader(node, aliases)):
                bad = f"{name} through DCP's FileSystemReader"
            elif name == "numpy.load" and any(k.arg == "allow_pickle" for k in getattr(node, "keywords", [])):
                bad = "numpy.load with allow_pickle"
            if bad and rel != GUARDED and (rel, name) not in ALLOWED:
                found.append(f"{rel}:{node.lineno}: {bad}")
    return found


def test_no_unguarded_unpickling_in_the_code():
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 100
    found = [hit for f in files for hit in unguarded(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, ("unguarded unpickling (load checkpoints through autoplan.train.safe_load.open_checkpoint, "
                       "tensors with torch.load(..., weights_only=True)):\n" + "\n".join(found))


@pytest.mark.parametrize("snippet, flagged", [
    ("import pickle\npickle.load(f)", True),
    ("import pickle as p\np.loads(b)", True),
    ("from pickle import loads as undo\nundo(b)", True),
    ("import pickle\nclass U(pickle.Unpickler): pass", True),
    ("import torch\ntorch.load(f)", True),
    ("import torch\ntorch.load(f, weights_only=False)", True),
    ("from torch import load\nload(f, map_location='cpu')", True),
    ("import torch\ntorch.load(f, map_location='cpu', weights_only=True)", False),
    ("import torch.distributed.checkpoint as dcp\ndcp.load(sd, checkpoint_id=d)", True),
    ("import torch.distributed.checkpoint as dcp\ndcp.load(sd, storage_reader=dcp.FileSystemReader(d))", True),
    ("from torch.distributed.checkpoint import HuggingFaceStorageReader as H\n"
     "import torch.distributed.checkpoint as dcp\ndcp.load(sd, storage_reader=H(d))", False),
    ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\ndcp_to_torch_save(a, b)", True),
    ("import numpy as np\nnp.load(f, allow_pickle=True)", True),
    ("import json\njson.load(f)", False),
])
def test_the_scan_sees_through_aliases(snippet, flagged):
    assert bool(unguarded(snippet)) == flagged, unguarded(snippet)
