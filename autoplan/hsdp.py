"""plan_hsdp(model, devices, tp=...) -> Plan: data parallel as dp_replicate x dp_shard (HSDP).

FSDP over all dp ranks all-gathers every layer across the whole data-parallel world; at 512
GPUs that is inter-node traffic on every layer. HSDP shards parameters within a dp_shard group
(one or a few nodes) and keeps dp_replicate copies of that sharded model, paying one
all-reduce of the sharded gradients across replicas per step instead. Which split is best
depends on the links and on memory (parameters, gradients and optimizer state are divided by
dp_shard only), so the candidates are the splits whose shard groups respect node boundaries
(``hsdp_splits.hsdp_splits``), each priced by the cost model:

- the TP styles, TP collectives, FSDP traffic over dp_shard and per-rank memory come from
  ``autoplan()`` on the mesh (dp_shard, tp) with the batch of one replica (global / replicate):
  each rank sees exactly the shard group and the batch it will see in the HSDP mesh, and the
  dp_shard group's links are the same (tp is innermost in both meshes);
- the dp_replicate all-reduces (one per reduce-scatter, of the sharded gradient) are added as
  exact collective rows, and their alpha-beta time on the HSDP mesh's links, exposed by the
  overlap rule FSDP traffic gets (``tp.search.exposed_dp``), is added to the step.

The winner is a plan on the mesh (dp_replicate, dp_shard, tp) with ``fsdp.replicate_dim``, built
from the replica plan by ``autoplan.assembler.to_hsdp`` (re-exported here); the runner applies ``fully_shard`` on the 2-D (dp_replicate, dp_shard) mesh and verify checks it
exactly. The other splits are listed in ``plan.alternatives``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from autoplan.api import autoplan
from autoplan.errors import InfeasiblePlanError, PlanningError
from autoplan.assembler import fastest_of, to_hsdp
from autoplan.plan.plan import Plan
from autoplan.request import check_devices_per_node
from autoplan.search.data.hsdp_splits import DP_SHARD, hsdp_splits
from cost_models.hardware import load_hardware
from hyper_parallel.parallel_dims import ParallelDims

log = logging.getLogger(__name__)


def plan_hsdp(model: torch.nn.Module, devices: int, *, tp: int, batch: tuple[int, int], hardware: str = "h100_sxm",
              devices_per_node: int | None = None, split: tuple[int, int] | None = None,
              memory_limit: float | None = None, dtype: torch.dtype | None = None,
              **autoplan_kwargs: Any) -> Plan:
    """The best HSDP plan for ``devices`` = dp_replicate x dp_shard x ``tp`` devices.

    ``split``: force ``(replicate, shard)``; default: every node-aligned split, priced. Other
    keywords go to ``autoplan()`` (e.g. ``allow_replicated_units``, ``sequence_parallel``).
    Raises PlanningError for degrees that do not divide, InfeasiblePlanError when no split fits.
    """
    if tp < 1 or devices % tp:
        raise PlanningError(f"plan_hsdp: tp={tp} must divide devices={devices}")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise PlanningError(f"plan_hsdp: batch must be (global_batch, seq_len), got {batch!r}")
    dp = devices // tp
    per_node = check_devices_per_node(devices_per_node, devices, "plan_hsdp") or load_hardware(hardware).devices_per_node
    splits = [tuple(split)] if split is not None else hsdp_splits(dp, tp, per_node)
    for r, s in splits:
        if r * s != dp or s < 2:
            raise PlanningError(f"plan_hsdp: split (replicate={r}, shard={s}) must multiply to dp={dp} "
                                "with shard >= 2")
    gb, seq = int(batch[0]), int(batch[1])
    plans, failures = [], []
    for r, s in splits:
        if gb % (r * s):
            failures.append(f"({r}, {s}): global batch {gb} not divisible by dp={r * s}")
            continue
        spec = ParallelDims((s, tp), (DP_SHARD, "tp"), hardware, per_node)
        try:
            sub = autoplan(model, spec, batch=(gb // r, seq), hardware=hardware, memory_limit=memory_limit,
                           dtype=dtype, fsdp=True, **autoplan_kwargs)
        except InfeasiblePlanError as e:
            failures.append(f"({r}, {s}): {e}")
            continue
        plans.append(to_hsdp(sub, r, gb) if r > 1 else sub)
    if not plans:
        raise InfeasiblePlanError(f"plan_hsdp: no (replicate, shard) split of dp={dp} works: {failures}")
    best = fastest_of(plans, "hsdp")
    log.info("plan_hsdp: %d splits priced, best %s at %.4g s/step", len(plans),
             dict(zip(best.mesh["names"], best.mesh["shape"])), best.predictions["step_s"])
    return best
