"""Functions run on every rank of a RankPool by the meta-first tests (tests/train/test_weights.py):
build on meta, apply a plan, then materialise or load pretrained weights, and gather what the
ranks hold for comparison with one device."""
from __future__ import annotations

import torch

from autoplan.plan import Plan
from autoplan.train.checkpoint import gathered_state
from autoplan.train.env import plan_mesh
from autoplan.train.model import build_model


def materialized_state(model: str, overrides: dict, plan_json: str, seed: int) -> dict:
    """The full parameters (``model.<fqn>``) after meta build -> apply -> materialize."""
    plan = Plan.from_json(plan_json)
    meta = build_model(model, overrides=overrides, device="meta")
    runner = plan.apply(meta, plan_mesh(plan, torch.device("cpu")))
    runner.materialize(seed=seed)
    return {k: v for k, v in gathered_state(runner).items() if k.startswith("model.")}
