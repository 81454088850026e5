"""Module patterns for block groups that share a container.

A model's repeated blocks can fall into several groups under one container (T5's first block,
Gemma-2's alternating layers, DeepSeek-V3's dense layers beside its MoE layers). The planner writes
the largest group's styles once with ``prefix.*`` and the others per index, relying on the most
specific pattern winning; where a smaller group leaves a module unstyled, nothing more specific
exists there and the wildcard would reach it -- those patterns are named per member instead.
"""
from __future__ import annotations


def wildcard_group(blocks, prefix: str):
    """The block group under ``prefix`` whose styles are written with ``prefix.*``: the largest
    (ties: the one starting first)."""
    siblings = [g for g in blocks if g.prefix == prefix]
    return max(siblings, key=lambda g: (g.count, -int(g.indices[0]) if g.indices[0].isdigit() else 0))


def seal_group_wildcards(styles: dict, blocks, modules) -> dict:
    """``styles`` with every ``prefix.*.rest`` pattern that would also reach a module of another
    block group under the same prefix -- one that group leaves unstyled, so no more specific
    pattern wins there (DeepSeek-V3's dense layers beside its MoE layers) -- replaced by one
    pattern per member of its own group. ``modules``: every module FQN of the model."""
    out = dict(styles)
    for prefix in {b.prefix for b in blocks}:
        groups = [g for g in blocks if g.prefix == prefix]
        if len(groups) < 2:
            continue
        own = wildcard_group(blocks, prefix)
        others = [i for g in groups if g is not own for i in g.indices]
        join = (lambda i, rest: ".".join(x for x in (prefix, i, rest) if x))
        head = f"{prefix}.*" if prefix else "*"
        for pattern in list(out):
            if pattern != head and not pattern.startswith(head + "."):
                continue
            rest = pattern[len(head) + 1:]
            if any(join(i, rest) in modules and join(i, rest) not in out for i in others):
                spec = out.pop(pattern)
                out.update({join(j, rest): spec for j in own.indices})
    return out
