"""Collective counts per module, forward and backward, from torch's CommDebugMode (tests only).

CommDebugMode keys modules by "<RootClass>.<fqn>" and collectives by funcol op; we return
plain FQNs and the kind names of :mod:`hyper_parallel.local.collectives`, the vocabulary plans use
for their predicted collectives.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.local.collectives import kind_of


def count_collectives(model: nn.Module, fn: Callable[[], object]) -> tuple[dict, dict]:
    """Run ``fn`` under CommDebugMode; returns (totals {kind: n}, per_module {fqn: {phase: {kind: n}}}).

    Per-module counts include the module's descendants (a block counts its linears' collectives);
    the root model is "" and collectives outside any module are under "Global".
    """
    mode = CommDebugMode()
    with mode:
        fn()
    totals: dict[str, int] = defaultdict(int)
    for op, n in mode.get_comm_counts().items():
        totals[kind_of(op)] += n
    root = type(model).__name__
    per_module: dict[str, dict[str, dict[str, int]]] = {}
    for name, phases in mode.comm_module_counts.items():
        fqn = "" if name == root else name[len(root) + 1:] if name.startswith(root + ".") else name
        per_module[fqn] = {
            phase: dict(sorted((kind_of(op), n) for op, n in counts.items()))
            for phase, counts in phases.items()
        }
    return dict(totals), per_module
