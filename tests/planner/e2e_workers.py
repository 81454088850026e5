"""Rank functions for the planner's end-to-end tests: autoplan -> apply -> one step == one device."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoplan.models import build_llama
from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import cached_mesh, grads_by_name
from tests.planner.models import hf_model

SMALL_LLAMA = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=32)
HF_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)


def build(name: str, device: str = "cpu"):
    if name == "llama":
        return build_llama(seed=5, device=device, **SMALL_LLAMA)
    if name == "llama_tied":
        return build_llama(seed=5, device=device, tie_embeddings=True, **SMALL_LLAMA)
    if name == "llama_uneven":   # vocabulary 130 and MLP hidden 90: neither divides tp=4
        return build_llama(seed=5, device=device, **dict(SMALL_LLAMA, vocab_size=130, ffn_hidden=90))
    if name == "llama_kv2":
        return build_llama(seed=5, device=device, **dict(SMALL_LLAMA, n_kv_heads=2))
    if name in ("hf_llama", "hf_qwen2", "hf_mistral", "hf_llama_tied", "hf_llama_uneven", "hf_qwen3"):
        kind = name.split("_")[1]
        cfg = dict(HF_SMALL, tie_word_embeddings=name.endswith("tied"))
        if name.endswith("uneven"):
            cfg.update(vocab_size=130, intermediate_size=90)
        if kind == "mistral":
            cfg["sliding_window"] = None
        if kind == "qwen3":   # per-head q/k norms; head_dim is a config field (default 128)
            cfg["head_dim"] = HF_SMALL["hidden_size"] // HF_SMALL["num_attention_heads"]
        model = hf_model(kind, device=device, seed=5, **cfg)
        if device != "meta":
            torch.manual_seed(5)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.05)
        return model
    raise KeyError(name)


def setup_case(plan_json: str, model_name: str, lr: float, batch: int = 4, seq: int = 16):
    """(one-device model, model with the plan applied and an SGD runner, tokens, targets): the
    start every plan-vs-one-device worker shares."""
    plan = Plan.from_json(plan_json)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    ref, par = build(model_name), build(model_name)
    runner = plan.apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=lr)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 128, (batch, seq), generator=g)
    targets = torch.randint(0, 128, (batch, seq), generator=g)
    return ref, par, runner, tokens, targets


def run_case(plan_json: str, model_name: str, lr: float = 0.1):
    """SGD, so that 'parameters after the step agree' inherits the gradients' tolerance (AdamW's
    first step is ~lr*sign(grad), which turns float noise on near-zero gradients into lr-sized
    differences)."""
    ref, par, runner, tokens, targets = setup_case(plan_json, model_name, lr)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    g_ref = grads_by_name(ref)
    opt.step()
    local = runner.local_batch(tokens, targets)
    loss = torch.tensor(runner.step(local))
    if runner.dp_mesh is not None and runner.dp_mesh.size() > 1:
        dist.all_reduce(loss, group=runner.dp_mesh.get_group())
        loss /= runner.dp_mesh.size()
    g_par = grads_by_name(par)
    bad = [n for n, gr in g_ref.items() if n not in g_par or not torch.allclose(g_par[n], gr, rtol=1e-4, atol=1e-6)]
    p_ref = {n: p.detach() for n, p in ref.named_parameters()}
    p_par = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_parameters()}
    bad_params = [n for n in p_ref if not torch.allclose(p_par[n], p_ref[n], rtol=1e-4, atol=1e-6)]
    return {"ref": float(ref_loss.detach()), "par": float(loss), "bad_grads": bad[:5], "bad_params": bad_params[:5],
            "n_grads": len(g_ref)}
