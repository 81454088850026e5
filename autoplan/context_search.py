"""plan_context(model, devices, batch=...) -> Plan: dp x cp x tp for long sequences, chosen by cost.

Why a helper of its own: at 32K-128K tokens per sequence what fits in memory and what is fast
depend on how the devices are split between tensor parallel (divides weights and, with sequence
parallel, activations; its collectives grow with the tokens), context parallel (divides the
tokens of every op; adds the attention exchange, priced by ``autoplan.search.context.cost``) and
data parallel (needs a sequence per replica). It is the cluster search (``plan_cluster``, which
searches cp itself: ``autoplan/search/mesh/dims.py``) restricted to one split at a time and no
pipeline: every split ``devices = dp * cp * tp`` with tp inside a node, a sequence that cuts into
2*cp chunks and a global batch dp divides is planned by ``plan_cluster`` with those degrees fixed,
and the fastest plan that fits memory wins; the others are listed in ``plan.alternatives``
("cp <mesh>"). ``tp=`` / ``cp=`` restrict the degrees tried.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from autoplan.cluster import plan_cluster
from autoplan.errors import InfeasiblePlanError, InvalidArgumentError
from autoplan import assembler
from autoplan.plan.plan import Plan
from autoplan.request import check_devices_per_node
from cost_models.hardware import load_hardware

log = logging.getLogger(__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_meshes(devices: int, batch: tuple[int, int], devices_per_node: int,
                   tp: Sequence[int] | None = None, cp: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """The (dp, cp, tp) splits of ``devices`` worth planning: tp divides a node (or is in ``tp``),
    cp cuts the sequence into 2*cp chunks (or is in ``cp``), dp divides the global batch."""
    gb, seq = batch
    tps = list(tp) if tp is not None else [t for t in _divisors(devices_per_node) if devices % t == 0]
    out = []
    for t in tps:
        cps = list(cp) if cp is not None else _divisors(devices // t)
        for c in cps:
            if c < 1 or devices % (t * c) or seq % (2 * c):
                continue
            d = devices // (t * c)
            if gb % d == 0:
                out.append((d, c, t))
    return out


def plan_context(model: torch.nn.Module, devices: int, *, batch: tuple[int, int], hardware: str = "h100_sxm",
                 devices_per_node: int | None = None, tp: Sequence[int] | None = None,
                 cp: Sequence[int] | None = None, memory_limit: float | None = None,
                 dtype: torch.dtype | None = None, **autoplan_kwargs: Any) -> Plan:
    """The fastest plan on a (dp, cp, tp) mesh of ``devices`` that fits memory.

    ``tp`` / ``cp``: restrict the degrees tried (default: every tp dividing a node, every cp the
    sequence allows). Other keywords go to ``autoplan()`` (``activation_checkpointing``, ...).
    Raises InvalidArgumentError for a malformed batch or no split, InfeasiblePlanError when no
    split fits memory (naming each split's reason).
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch):
        raise InvalidArgumentError(f"plan_context: batch must be (global_batch, seq_len) positive integers, "
                                   f"got {batch!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InvalidArgumentError(f"plan_context: devices={devices!r} must be a positive integer")
    per_node = check_devices_per_node(devices_per_node, devices, "plan_context") or load_hardware(hardware).devices_per_node
    splits = context_meshes(devices, tuple(batch), per_node, tp, cp)
    if not splits:
        raise InvalidArgumentError(f"plan_context: no dp x cp x tp split of {devices} devices fits batch {batch} "
                                   f"(tp {tp or 'dividing a node'}, cp {cp or 'any'}; the sequence must divide "
                                   "into 2*cp chunks and dp must divide the global batch)")
    plans, failures = [], []
    for d, c, t in splits:
        try:
            plans.append(plan_cluster(model, devices, batch=tuple(batch), hardware=hardware, devices_per_node=per_node,
                                      memory_limit=memory_limit, dtype=dtype,
                                      constraints={"dp": d, "cp": c, "tp": t, "pp": 1}, **autoplan_kwargs))
        except InfeasiblePlanError as e:
            failures.append(f"dp{d} x cp{c} x tp{t}: {str(e).split(';')[0]}")
    if not plans:
        raise InfeasiblePlanError(f"plan_context: no split of {devices} devices fits: {failures}")
    best = assembler.with_notes(assembler.fastest_of(plans, "cp"), [
        f"plan_context: {len(plans)} dp x cp x tp splits fit, {len(failures)} did not"
        + (f" ({'; '.join(failures)})" if failures else "")])
    log.info("plan_context: %d splits priced, best %s at %.4g s/step", len(plans),
             dict(zip(best.mesh["names"], best.mesh["shape"])), best.predictions["step_s"])
    return best
