"""Path and shape helpers role recognition shares (roles.py and mixer_roles.py)."""
from __future__ import annotations

from typing import Iterable

from autoplan.capture.ir import ModelGraph, Node


def lca(fqns: Iterable[str]) -> str:
    """The longest common dotted prefix of module paths (their nearest common parent)."""
    parts = [f.split(".") for f in fqns]
    if not parts:
        return ""
    out = []
    for col in zip(*parts):
        if len(set(col)) != 1:
            break
        out.append(col[0])
    return ".".join(out)


def rel(fqn: str, base: str) -> str:
    """``fqn`` relative to the block representative ``base`` ("" for the block itself)."""
    if base and fqn == base:
        return ""
    return fqn[len(base) + 1:] if base and fqn.startswith(base + ".") else fqn


def out_features(n: Node) -> int:
    return n.outputs[0].shape[-1] if n.outputs else 0


def param_shape(graph: ModelGraph, fqn: str) -> tuple[int, ...]:
    owner, _, name = fqn.rpartition(".")
    info = graph.modules.get(owner)
    return info.params.get(name, ()) if info else ()
