"""Rank function for ZeRO-1 plans: the parameters after one SGD step, and this rank's reduced
gradient slice, against one device (ZeRO-1 leaves whole averaged gradients on no rank)."""
from __future__ import annotations

import torch

from autoplan.plan import Plan
from autoplan.plan.data_parallel import unique_params
from tests.planner.e2e_workers import build, run_case


def run_zero1_case(plan_json: str, model_name: str, lr: float = 0.1) -> dict:
    out = run_case(plan_json, model_name, lr)   # loss and parameters after the step (grads differ by design)
    plan = Plan.from_json(plan_json)
    from hyper_parallel.testing import cached_mesh

    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    ref, par = build(model_name), build(model_name)
    runner = plan.apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (4, 16), generator=g)
    targets = torch.randint(0, 128, (4, 16), generator=g)
    from autoplan.plan.runner import _logits, lm_loss

    lm_loss(_logits(ref(tokens)), targets).backward()
    runner.step(runner.local_batch(tokens, targets))
    z = runner.zero1
    # the one-device gradients of this rank's TP-local parameters, flattened in ZeRO-1's order
    names = {id(p): n for n, p in par.named_parameters()}
    ref_p = dict(ref.named_parameters())
    flat = []
    for p in unique_params(par):
        gr = ref_p[names[id(p)]].grad
        local = p.to_local() if hasattr(p, "to_local") else p
        if hasattr(p, "placements") and local.shape != gr.shape:
            from torch.distributed.tensor import distribute_tensor

            gr = distribute_tensor(gr, p.device_mesh, p.placements).to_local()
        flat.append(gr.reshape(-1))
    flat = torch.cat(flat)
    flat = torch.cat([flat, flat.new_zeros(z.padded_numel() - flat.numel())])
    shard = z.padded_numel() // z.world
    want = flat[z.rank * shard:(z.rank + 1) * shard]
    out["grad_slice_ok"] = bool(torch.allclose(z.master.grad, want, rtol=1e-4, atol=1e-6))
    out["bad_grads"] = []
    return out
