"""The plan of a run: a plan file, or planned on the spot for this world size.

Planning on the spot runs ``plan_cluster`` on a meta copy of the model before the process group
starts, on every rank: planning is deterministic, so every rank gets the identical plan, and the
planner checks its strategies on a fake process group of its own, which it can only start while
no real one exists in the process. Inside an already started job (the Python API called under
torchrun after ``init_process_group``) rank 0 plans and sends the JSON; its strategy checks are
then skipped and the plan says so.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from autoplan.cluster import plan_cluster
from autoplan.plan import Plan
from autoplan.train.config import TrainConfig
from autoplan.train.model import build_model

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
    """Rank 0 plans (or reads ``cfg.plan``); every rank returns the same Plan."""
    if cfg.plan:
        return Plan.from_json(cfg.plan)
    if not dist.is_initialized():
        return _plan(cfg, world, device)
    box = [None]
    if dist.get_rank() == 0:
        box[0] = _plan(cfg, world, device).to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])


class _ProbeFailures(logging.Filter):
    """Swallows torch's fake-tensor ERROR records (each a full traceback) while the planner probes
    layouts: a probe that fails is how the planner learns a sharding cannot work (e.g. OLMo-2's
    q/k norm over tensor-parallel heads printed ~300 traceback lines on rank 0). They are
    counted into the plan's notes and logged at debug level, one line each."""

    def __init__(self):
        super().__init__()
        self.count, self.first = 0, None

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        line = f"{record.getMessage().splitlines()[0]}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}" \
            if exc is not None else record.getMessage().splitlines()[0]
        self.count += 1
        self.first = self.first or line
        log.debug("planning probe failed under fake tensors (expected): %s", line)
        return False


def _plan(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
    hardware = cfg.hardware or ("cpu" if device.type == "cpu" else "h100_sxm")
    meta = build_model(cfg.model, layers=cfg.layers, overrides=cfg.model_args, device="meta")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    probes = _ProbeFailures()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addFilter(probes)
    try:
        plan = plan_cluster(meta, world, hardware=hardware, batch=(cfg.batch, cfg.seq), devices_per_node=per_node,
                            constraints=dict(cfg.constraints), allow_replicated_units=not cfg.shard_all,
                            dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    finally:
        fake_log.removeFilter(probes)
    if probes.count:
        plan.notes.append(f"planning: {probes.count} layout probe(s) failed under fake tensors, as expected for a "
                          f"sharding the model's shapes cannot take (first: {probes.first})")
    plan.model["source"] = cfg.model
    if cfg.layers:
        plan.model["layers_override"] = cfg.layers
    log.info("planned on the spot for %d ranks: %s", world, plan)
    return Plan.from_json(plan.to_json())
