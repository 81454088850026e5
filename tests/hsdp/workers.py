"""Rank function: an HSDP plan (dp_replicate x dp_shard x tp) applied, one SGD step == one device."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import grads_by_name
from tests.planner.e2e_workers import setup_case


def run_hsdp_case(plan_json: str, model_name: str, batch: int, seq: int, lr: float = 0.1) -> dict:
    ref, par, runner, tokens, targets = setup_case(plan_json, model_name, lr, batch, seq)
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    g_ref = grads_by_name(ref)
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    local = runner.local_batch(tokens, targets)
    loss = torch.tensor(runner.step(local), dtype=torch.float64)
    dist.all_reduce(loss)  # every tp rank of a dp rank holds the same local loss
    loss /= dist.get_world_size()
    g_par = grads_by_name(par)
    bad = [n for n, gr in g_ref.items() if n not in g_par or not torch.allclose(g_par[n], gr, rtol=1e-4, atol=1e-6)]
    p_ref = {n: p.detach() for n, p in ref.named_parameters()}
    p_par = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_parameters()}
    bad_params = [n for n in p_ref if not torch.allclose(p_par[n], p_ref[n], rtol=1e-4, atol=1e-6)]
    # HSDP really is 2-D: this rank's block holds 1/dp_shard of the weight, replicated across dp_replicate
    w = next(p for n, p in par.named_parameters() if n.endswith("feed_forward.w1.weight"))
    return {"ref": float(ref_loss.detach()), "par": float(loss), "bad_grads": bad[:5], "bad_params": bad_params[:5],
            "n_grads": len(g_ref), "placements": [type(p).__name__ for p in w.placements],
            "mesh": list(w.device_mesh.mesh_dim_names)}
