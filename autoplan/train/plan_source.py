"""The plan of a run: a plan file, or planned on the spot for this world size.

Planning on the spot runs ``plan_cluster`` on a meta copy of the model on rank 0 only and sends
the JSON to the other ranks, so every rank applies the identical plan without each spending the
planning time.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.train.config import TrainConfig
from autoplan.train.model import build_model

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
    """Rank 0 plans (or reads ``cfg.plan``); every rank returns the same Plan."""
    if cfg.plan:
        return Plan.from_json(cfg.plan)
    box = [None]
    if dist.get_rank() == 0:
        from autoplan import plan_cluster

        hardware = cfg.hardware or ("cpu" if device.type == "cpu" else "h100_sxm")
        meta = build_model(cfg.model, layers=cfg.layers, overrides=cfg.model_args, device="meta")
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        plan = plan_cluster(meta, world, hardware=hardware, batch=(cfg.batch, cfg.seq), devices_per_node=per_node,
                            constraints=dict(cfg.constraints), allow_replicated_units=not cfg.shard_all,
                            dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
        plan.model["source"] = cfg.model
        if cfg.layers:
            plan.model["layers_override"] = cfg.layers
        log.info("planned on the spot for %d ranks: %s", world, plan)
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0])
