"""Rank functions: a pipelined plan from plan_cluster, applied, one step == one device."""
from __future__ import annotations

import torch

from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from autoplan.models import build_llama
from hyper_parallel.local import cached_mesh
from tests.planner.e2e_workers import SMALL_LLAMA
from tests.planner.e2e_workers import build as _build

# a vocabulary large enough that the planner prefers loss parallel to gathering the logits
BIG_VOCAB = dict(SMALL_LLAMA, vocab_size=65536)


def build(name: str, device: str = "cpu"):
    if name == "llama_big_vocab":
        return build_llama(seed=5, device=device, **BIG_VOCAB)
    return _build(name, device)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_pipeline_case(plan_json: str, model_name: str, batch: int = 8, seq: int = 16, lr: float = 0.1) -> dict:
    """SGD (so 'parameters after the step agree' inherits the gradients' tolerance)."""
    plan = Plan.from_json(plan_json)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    ref, par = build(model_name), build(model_name)
    runner = plan.apply(par, mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=lr))
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (batch, seq), generator=g)
    targets = torch.randint(0, 128, (batch, seq), generator=g)
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    g_ref = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    p_ref = {n: p.detach() for n, p in ref.named_parameters()}
    loss = runner.step(runner.local_batch(tokens, targets))
    bad_grads, bad_params, n = [], [], 0
    for st in runner.stages:
        for name, p in st.module.named_parameters():
            n += 1
            got = _full(p.grad) if p.grad is not None else torch.zeros_like(g_ref[name])
            if not torch.allclose(got, g_ref[name], rtol=1e-4, atol=1e-6):
                bad_grads.append(name)
            if not torch.allclose(_full(p).detach(), p_ref[name], rtol=1e-4, atol=1e-6):
                bad_params.append(name)
    return {"ref": float(ref_loss.detach()), "par": loss, "bad_grads": bad_grads[:5], "bad_params": bad_params[:5],
            "n_params": n}
