"""The plan of a run: a plan file, or planned on the spot for this world size.

Planning on the spot runs ``plan_cluster`` on a meta copy of the model on every rank, before or
after the process group starts: the planner is deterministic (no solver time limits, no random
choices, nothing read from the rank) and checks its strategies on a fake process group in a c10d
world of its own (``hyper_parallel.local.isolated_world``), so inside a started job every rank
computes the same plan offline planning gives, with no traffic on the job's groups. Every rank
planning itself -- rather than rank 0 planning and broadcasting -- keeps ``autoplan`` /
``plan_cluster`` free of collectives (they may be called on any subset of ranks), and lets no
rank wait on another's planning. What a train job adds, once the group is up, is one small check
that the ranks agree (a digest of the plan, gathered): a rank with another plan would build other
meshes and hang in its first collective, so a mismatch is a typed error at start-up instead.
"""
from __future__ import annotations

import hashlib
import logging
import os

import torch
import torch.distributed as dist

from autoplan.cluster import plan_cluster
from autoplan.plan import Plan
from autoplan.train.config import TrainConfig
from autoplan.train.errors import TrainConfigError
from autoplan.train.model import build_model

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
    """This rank's plan (read from ``cfg.plan`` or planned here); every rank returns the same Plan
    (checked once the process group is up, see the module doc)."""
    plan = Plan.from_json(cfg.plan) if cfg.plan else _plan(cfg, world, device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        _check_ranks_agree(plan)
    return plan


def _check_ranks_agree(plan: Plan) -> None:
    digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        raise TrainConfigError(
            f"train: the ranks planned different plans (plan digest -> ranks: {groups}); every rank must see "
            f"the same model, config and environment (LOCAL_WORLD_SIZE, --hardware). Plan once with "
            f"`autoplan plan` and pass --plan plan.json to every rank")


def _plan(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
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
    return Plan.from_json(plan.to_json())
