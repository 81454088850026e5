"""Rank functions for MPipe plans: a plan from autoplan for the tiny VL model with a heavy
tower, applied with plan.apply on every rank; one step vs one device, the tower's gradients included."""
from __future__ import annotations

import copy
import functools

import torch

from autoplan.models.vision_language import build_vision_language, vl_batch
from autoplan.plan.plan import Plan
from hyper_parallel.local import cached_mesh
from tests.pipeline.mpipe_workers import _errors
from tests.pipeline.workers import lm_loss

HEAVY_TOWER = {"n_layers": 4, "width": 64, "mlp_hidden": 256}


@functools.lru_cache(maxsize=None)
def _built():
    model = build_vision_language(seed=0, n_layers=4, n_patches=8, vision=HEAVY_TOWER)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def heavy_vl():
    return copy.deepcopy(_built())


def run_mpipe_plan(plan_json: str, batch: int = 8, seq: int = 12) -> dict:
    """Apply the plan, run one step (SGD lr=0: gradients stay for comparison), compare."""
    plan = Plan.from_json(plan_json)
    ref = heavy_vl()
    x, pv, y = vl_batch(ref, batch, seq)
    ref_loss = lm_loss(ref(x, pv), y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    model = heavy_vl()
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    runner = plan.apply(model, mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    x, y = runner.local_batch(x, y)   # this rank's dp share (the whole batch without dp)
    pv = runner.local_batch(pv, pv)[0]
    loss = runner.step((x, y), pixel_values=pv)
    grad_err, n_params = _errors([(n, p) for st in runner.stages for n, p in st.module.named_parameters()],
                                 ref_grads)
    tower_err, n_tower = _errors([("visual." + n, p) for n, p in model.visual.named_parameters()], ref_grads)
    return dict(loss_err=abs(loss - ref_loss.item()) / abs(ref_loss.item()), grad_err=grad_err,
                tower_err=tower_err, n_params=n_params, n_tower=n_tower)
