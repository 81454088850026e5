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


def train_pretrained(runs: list[dict], steps: int, lr: float) -> list[dict]:
    """For each run (``model``: a save_pretrained directory, ``plan``: a plan file, ``export``: an
    empty directory): train ``steps`` steps from the directory's weights, export the result as an
    HF directory; returns the losses and the gathered parameters (rank 0's copy is read)."""
    from autoplan.train import TrainConfig, Trainer

    out = []
    for run in runs:
        tr = Trainer(TrainConfig(model=run["model"], plan=run["plan"], batch=8, seq=16, steps=steps, lr=lr,
                                 progress="none", checkpoint_dir=run.get("checkpoint_dir")))
        losses = tr.fit().losses
        state = {k[len("model."):]: v for k, v in tr.gathered_state().items() if k.startswith("model.")}
        tr.runner.export_hf(run["export"])
        out.append({"losses": losses, "state": state})
    return out


def refused_checkpoints(dirs: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """Each broken weights directory (with the plan of its model) must fail with PretrainedWeightsError in Trainer(...) on every
    rank, before any step (name: the first tensor at fault, file: the file at fault)."""
    from autoplan.errors import PretrainedWeightsError
    from autoplan.train import TrainConfig, Trainer

    out = {}
    for case, (path, plan) in dirs.items():
        try:
            Trainer(TrainConfig(model=path, plan=plan, batch=8, seq=16, steps=1, progress="none"))
            out[case] = {"error": None}
        except PretrainedWeightsError as e:
            out[case] = {"error": type(e).__name__, "name": e.name, "expected": e.expected, "found": e.found,
                         "file": e.file, "message": str(e)}
    return out


def packed_resume(model: str, plans: list[str], root: str) -> dict:
    """Train 2 steps under ``plans[0]`` saving a checkpoint, then resume it under each other plan:
    the gathered state right after each resume (a packed projection's strided shards included)."""
    from autoplan.train import TrainConfig, Trainer

    base = dict(model=model, batch=8, seq=16, lr=1e-3, progress="none", checkpoint_dir=root)
    first = Trainer(TrainConfig(plan=plans[0], steps=2, **base))
    first.fit()
    out = {"saved": first.gathered_state()}
    for plan in plans[1:]:
        tr = Trainer(TrainConfig(plan=plan, steps=3, **base))
        out[plan] = {"step": tr.step, "state": tr.gathered_state()}
    return out
