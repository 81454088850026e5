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
from autoplan.precision.request import with_precision
from autoplan.train.config import TrainConfig
from autoplan.train.errors import TrainConfigError
from autoplan.train.model import build_model

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, world: int, device: torch.device) -> Plan:
    """This rank's plan (read from ``cfg.plan`` or planned here); every rank returns the same Plan
    (checked once the process group is up, see the module doc)."""
    plan = Plan.from_json(cfg.plan) if cfg.plan else _plan(cfg, world, device)
    if cfg.precision != "auto" or not cfg.plan:
        meta = build_model(cfg.model, layers=cfg.layers, overrides=cfg.model_args, device="meta")
        plan = Plan.from_json(with_precision(plan, meta, cfg.precision).to_json())
        section = plan.parallel.get("precision") or {}
        log.info("precision %s: float8 %s; kept in high precision: %s", cfg.precision,
                 sorted(section.get("modules", {})) or "none", sorted(section.get("kept", {})) or "none")
    check_ranks_agree(plan)
    return plan


def check_ranks_agree(plan: Plan) -> None:
    """Every rank of the started job holds this same plan (a digest gathered; nothing before the
    process group is up). A plan made before ``init_process_group`` is checked by calling this
    again once it is."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
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
                            dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                            overlap="async_tp" if cfg.async_tp else None)   # priced as it will run
    finally:
        fake_log.removeFilter(probes)
    notes = [f"planning: {probes.count} layout probe(s) failed under fake tensors, as expected for a sharding the "
             f"model's shapes cannot take (first: {probes.first})"] if probes.count else []
    recorded = {"source": cfg.model, **({"layers_override": cfg.layers} if cfg.layers else {})}
    plan = plan.replace(model=dict(plan.model, **recorded), notes=list(plan.notes) + notes)
    log.info("planned on the spot for %d ranks: %s", world, plan)
    return Plan.from_json(plan.to_json())
