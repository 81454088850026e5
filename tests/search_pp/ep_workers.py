"""Rank functions: an ep x pp plan from plan_cluster (HF Mixtral / Qwen3-MoE, every parameter
perturbed), applied with plan.apply on gloo ranks; one SGD step equals one device -- the loss,
every gradient of this rank's stages, every parameter after the step. The router sees the same
weights and tokens on every rank and on one device, so routing is identical by construction."""
from __future__ import annotations

import torch

from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import cached_mesh
from tests.runtime.ep_workers import VOCAB, build


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_ep_pipeline(cases: list[tuple[str, str]], batch: int = 8, seq: int = 8, lr: float = 0.1) -> dict:
    """cases: (plan JSON, model name); returns label -> measurements (or the error)."""
    out = {}
    for plan_json, model_name in cases:
        plan = Plan.from_json(plan_json)
        label = f"{model_name}/{'x'.join(f'{n}{s}' for n, s in zip(plan.mesh['names'], plan.mesh['shape']))}"
        mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
        name, _, n_experts = model_name.partition(":")   # "mixtral:6": 6 experts
        ref, par = (build(name, n_experts=int(n_experts or 8))[0] for _ in range(2))
        runner = plan.apply(par, mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=lr))
        g = torch.Generator().manual_seed(11)
        tokens, targets = (torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(2))
        ref_loss = lm_loss(output_logits(ref(tokens)), targets)
        ref_loss.backward()
        g_ref = {n: p.grad.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
        torch.optim.SGD(ref.parameters(), lr=lr).step()
        local = runner.local_batch(tokens, targets)
        loss = runner.step(local)
        bad_grads, bad_params, n, experts_split = [], [], 0, 0
        for st in runner.stages:
            for name, p in st.module.named_parameters():
                n += 1
                got = _full(p.grad) if p.grad is not None else torch.zeros_like(g_ref[name])
                if not torch.allclose(got, g_ref[name], rtol=1e-4, atol=1e-6):
                    bad_grads.append(f"{name}: {(got - g_ref[name]).abs().max().item():.3g}")
                if not torch.allclose(_full(p).detach(), ref.get_parameter(name).detach(), rtol=1e-4, atol=1e-6):
                    bad_params.append(name)
                if ".experts." in name and "ep" in (getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names
                                                    or ()):
                    experts_split += 1
        out[label] = {"ref": float(ref_loss.detach()), "par": loss, "bad_grads": bad_grads[:5],
                      "bad_params": bad_params[:5], "n_params": n, "experts_split": experts_split,
                      "local_rows": int(local[0].shape[0])}
    return out
