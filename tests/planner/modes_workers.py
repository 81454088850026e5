"""Rank function for ZeRO-1 plans: loss, the parameters after one SGD step and this rank's
reduced gradient slice against one device (ZeRO-1 leaves whole averaged gradients on no rank)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

from autoplan.parallelisms.data import unique_params
from autoplan.plan.forward import lm_loss, output_logits
from tests.planner.e2e_workers import setup_case


def run_zero1_case(plan_json: str, model_name: str, lr: float = 0.1, batch: int = 4) -> dict:
    ref, par, runner, tokens, targets = setup_case(plan_json, model_name, lr, batch=batch)
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    # the one-device gradients of this rank's TP-local parameters, flattened in ZeRO-1's order
    ref_p = dict(ref.named_parameters())
    names = {id(p): n for n, p in par.named_parameters()}
    flat = []
    for p in unique_params(par):
        gr = ref_p[names[id(p)]].grad
        if hasattr(p, "placements"):
            gr = distribute_tensor(gr, p.device_mesh, p.placements).to_local()
        flat.append(gr.reshape(-1))
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    loss = torch.tensor(runner.step(runner.local_batch(tokens, targets)))
    dist.all_reduce(loss, group=runner.dp_mesh.get_group())
    loss /= runner.dp_mesh.size()
    z = runner.zero1
    flat = torch.cat(flat)
    flat = torch.cat([flat, flat.new_zeros(z.padded_numel() - flat.numel())])
    shard = z.padded_numel() // z.world
    want = flat[z.rank * shard:(z.rank + 1) * shard]
    p_par = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_parameters()}
    bad_params = [n for n, p in ref.named_parameters() if not torch.allclose(p_par[n], p.detach(), rtol=1e-4,
                                                                             atol=1e-6)]
    return {"ref": float(ref_loss.detach()), "par": float(loss), "bad_grads": [], "bad_params": bad_params[:5],
            "grad_slice_ok": bool(torch.allclose(z.master.grad, want, rtol=1e-4, atol=1e-6))}
