"""Rank functions for tests/planner/test_expert_plans.py: a plan from the planner for an MoE
model, applied with plan.apply on gloo ranks; one SGD step compared with one device (loss,
every gradient, every parameter after the step). Routing is identical by construction: the
same weights route the same tokens the same way on every rank and on one device."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import cached_mesh, grads_by_name
from tests.runtime.ep_workers import VOCAB, build


def run_plan(plan_json: str, model_name: str, batch: int = 4, seq: int = 8, lr: float = 0.1) -> dict:
    plan = Plan.from_json(plan_json)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    name, _, n_experts = model_name.partition(":")   # "mixtral:6": 6 experts (ep_workers.run_case's convention)
    ref, _ = build(name, n_experts=int(n_experts or 8))
    par, _ = build(name, n_experts=int(n_experts or 8))
    runner = plan.apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    tokens, targets = (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    g_ref = grads_by_name(ref)
    opt.step()
    local = runner.local_batch(tokens, targets)
    loss = torch.tensor(runner.step(local))
    shards = 1
    for m in (runner.dp_mesh, runner.ep_mesh):   # each rank's loss is its batch shard's mean
        if m is not None and m.size() > 1:
            dist.all_reduce(loss, group=m.get_group())
            shards *= m.size()
    loss /= shards
    g_par = grads_by_name(par)
    bad = [f"{n}: {(g_par[n] - gr).abs().max().item():.3g}" if n in g_par else f"{n}: missing"
           for n, gr in g_ref.items() if n not in g_par or not torch.allclose(g_par[n], gr, rtol=1e-4, atol=1e-6)]
    p_par = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_parameters()}
    bad_params = [n for n, p in ref.named_parameters() if not torch.allclose(p_par[n], p.detach(), rtol=1e-4, atol=1e-6)]
    sharded = sorted(n for n, p in par.named_parameters() if ".experts." in n and hasattr(p, "device_mesh")
                     and "ep" in (p.device_mesh.mesh_dim_names or ()))
    # FSDP's shards of the parameters outside the experts: (mesh dims, local rows, global rows)
    dense = {n: (p.device_mesh.mesh_dim_names, p.to_local().shape[0], p.shape[0]) for n, p in par.named_parameters()
             if ".experts." not in n and hasattr(p, "device_mesh")}
    return {"ref": float(ref_loss.detach()), "par": float(loss), "bad_grads": bad[:5], "bad_params": bad_params[:5],
            "n_grads": len(g_ref), "ep_sharded": len(sharded), "local_rows": int(local[0].shape[0]),
            "dense_shards": dense}


def run_all(cases: list[tuple[str, str, str]]) -> dict:
    """cases: (label, plan JSON, model name[, global batch rows])."""
    out = {}
    for label, plan_json, model_name, *batch in cases:
        try:
            out[label] = run_plan(plan_json, model_name, *batch)
        except Exception:  # noqa: BLE001 - reported per case
            import traceback
            out[label] = {"error": traceback.format_exc()[-1500:]}
    return out


def save_and_resume(plan_json: str, model_name: str, root: str, lr: float = 0.1) -> dict:
    """Two SGD steps of ``plan`` with a DCP checkpoint after the first (``autoplan.train.checkpoint``),
    then a fresh model and runner (other initial weights) resumed from it takes the second step:
    its loss and every gathered parameter after it must equal the uninterrupted run's bit for bit."""
    from autoplan.train import checkpoint

    plan = Plan.from_json(plan_json)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    g = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, VOCAB, (4, 8), generator=g) for _ in range(2)) for _ in range(2)]

    def runner_for(seed: int):
        model, _ = build(model_name, seed=seed)
        runner = plan.apply(model, mesh)
        runner.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        return model, runner

    model, runner = runner_for(0)
    runner.step(runner.local_batch(*batches[0]))
    path = checkpoint.save(runner, root, 1, {"note": "ep"})
    loss = runner.step(runner.local_batch(*batches[1]))
    other, resumed = runner_for(1)
    state = checkpoint.load(resumed, other, path)
    loss2 = resumed.step(resumed.local_batch(*batches[1]))

    def whole(m):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in m.named_parameters()}

    a, b = whole(model), whole(other)
    return {"step": state["step"], "loss": loss, "resumed_loss": loss2,
            "differ": [n for n in a if not torch.equal(a[n], b[n])][:5], "n": len(a)}
