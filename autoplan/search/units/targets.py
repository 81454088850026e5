"""Which pipeline units a tensor-parallel option's cost and collectives land on.

The TP search prices options per slot (a block group's attention, the embedding, the head...); the
cluster search prices per pipeline unit (each block, the embedding, the final norm, the head), and
a plan's per-rank collectives follow the units a stage holds. This is the one mapping between the
two, used by both (``mesh.search.ClusterSearch.unit_costs`` and ``cluster``'s per-rank rows).
"""
from __future__ import annotations

from typing import Sequence


def block_members(structure) -> dict[str, set[str]]:
    """Block group id -> its members' unit names: a ``prefix.*`` owner covers only its own
    group's blocks when two groups share a prefix (DeepSeek-V3's dense and MoE layers)."""
    return {b.id: {f"{b.prefix}.{i}" if b.prefix else str(i) for i in b.indices} for b in structure.blocks}


def option_units(o, names: list[str], index: dict[str, int], emb_i: int, norm_i: int, head_i: int,
                 members: dict | None = None) -> list[int]:
    """Indices into ``names`` (the pipeline units) of the units option ``o`` applies to: a block
    option to every block its owner pattern names (only its own group's, ``members``); the stream's
    entry to the first block; the embedding, final norm and head options to their units; anything
    else (the loss, rotary tables) to the head, the last stage."""
    if o.in_block:
        out = []
        mine = (members or {}).get(o.slot.split("/")[0])
        for pat in o.owner.split(","):
            if pat.endswith(".*"):
                pre = pat[:-1]
                out += [i for i, n in enumerate(names) if n.startswith(pre) and "." not in n[len(pre):]
                        and (mine is None or n in mine)]
            elif pat in index:
                out.append(index[pat])
        return out
    if o.slot == "entry":   # the stream's layout change is a style on the first block's input
        firsts = [index[n] for ms in (members or {}).values() for n in ms if n in index]
        return [min(firsts)] if firsts else [emb_i]
    if o.slot == "embedding":
        return [emb_i]
    if o.slot == "final_norm":
        return [norm_i]
    return [head_i]


def owner_units(owner: str, prefix: str, indices: Sequence[str]) -> list[str]:
    """The pipeline units an option's owner names: every block of the group for a pattern owner
    (``layers.*``), else the owner itself."""
    if owner.endswith(".*") or owner == "*":
        return [f"{prefix}.{i}" if prefix else str(i) for i in indices]
    return [owner]
