"""Rank function for mixed precision: a plan applied with FSDP2's MixedPrecisionPolicy (bf16
params/compute, fp32 reduce, fp32 master weights) against a bf16 one-device run."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import cached_mesh, grads_by_name
from tests.planner.e2e_workers import build


def run_mp_case(plan_json: str, model_name: str) -> dict:
    plan = Plan.from_json(plan_json)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    ref, par = build(model_name), build(model_name)
    ref = ref.to(torch.bfloat16)        # the one-device bf16 run (params, compute and grads in bf16)
    runner = plan.apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (4, 16), generator=g)
    targets = torch.randint(0, 128, (4, 16), generator=g)
    ref_loss = lm_loss(output_logits(ref(tokens)).float(), targets)
    ref_loss.backward()
    g_ref = {n: v.float() for n, v in grads_by_name(ref).items()}
    masters = {n: (p.to_local() if hasattr(p, "to_local") else p).dtype for n, p in par.named_parameters()}
    local = runner.local_batch(tokens, targets)
    loss = torch.tensor(float(runner.step(local)))
    if runner.dp_mesh is not None and runner.dp_mesh.size() > 1:
        dist.all_reduce(loss, group=runner.dp_mesh.get_group())
        loss /= runner.dp_mesh.size()
    g_par = grads_by_name(par)
    grad_dtypes = {str(v.dtype) for v in g_par.values()}
    # worst |difference| per gradient, in units of that gradient's largest reference entry
    err = {n: float((g_par[n].float() - gr).abs().max() / gr.abs().max().clamp_min(1e-12))
           for n, gr in g_ref.items() if n in g_par}
    return {"ref": float(ref_loss.detach()), "par": float(loss), "missing": sorted(set(g_ref) - set(g_par)),
            "worst_grad": max(err.values()), "worst_name": max(err, key=err.get),
            "master_dtypes": sorted({str(d) for d in masters.values()}), "grad_dtypes": sorted(grad_dtypes)}
