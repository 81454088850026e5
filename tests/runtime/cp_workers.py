"""Rank functions for tests/runtime/test_context_parallel.py: the repo Llama, HF Llama and HF Qwen3
under context parallelism (ring and all-gather), alone and with tp and FSDP, one device as reference."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel import (
    ColwiseParallel,
    ContextParallel,
    RowwiseParallel,
    SequenceParallel,
    apply_context_parallel,
    average_gradients,
    cp_cross_entropy,
    loss_parallel,
    parallelize_module,
    shard_batch,
    unshard_sequence,
)
from hyper_parallel.core.context_parallel import shard_sequence
from hyper_parallel.errors import DivisibilityError, LayoutError, MeshError, StyleSpecError
from hyper_parallel.local import cached_mesh
from hyper_parallel.testing.compare import compare_steps

VOCAB, BATCH = 64, 2
MESHES = {  # layout -> (shape, names); "x" is an idle replica dimension (the same run on each of its groups)
    "cp2": ((2, 2), ("x", "cp")), "cp4": ((4,), ("cp",)), "cp2_tp2": ((2, 2), ("cp", "tp")),
    "dp2_cp2": ((2, 2), ("dp", "cp")), "dp2_cp2_tp2": ((2, 2, 2), ("dp", "cp", "tp")),
}


def _perturb(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)   # norms too: no parameter keeps its init
    return model


class HFLogits(nn.Module):
    """An HF causal LM returning plain logits (``positions`` reach it as position_ids)."""

    def __init__(self, kind: str):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

        common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
        torch.manual_seed(5)
        self.lm = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "hf_llama"
                   else Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)))

    def forward(self, tokens, position_ids=None):
        return self.lm(input_ids=tokens, position_ids=position_ids).logits


def build(kind: str) -> nn.Module:
    if kind == "llama":
        model = build_llama(seed=3, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden=64,
                            max_seq_len=32)
    else:
        model = HFLogits(kind)
    return _perturb(model, 11)


def tp_plan(kind: str) -> dict:
    if kind == "llama":  # torchtitan's plan: sequence parallel inside each cp shard
        return EXPERT_PLANS["torchtitan_no_loss_parallel"]()
    a, m = "lm.model.layers.*.self_attn", "lm.model.layers.*.mlp"
    plan = {f"{a}.q_proj": ColwiseParallel(), f"{a}.k_proj": ColwiseParallel(), f"{a}.v_proj": ColwiseParallel(),
            f"{a}.o_proj": RowwiseParallel(), f"{m}.gate_proj": ColwiseParallel(), f"{m}.up_proj": ColwiseParallel(),
            f"{m}.down_proj": RowwiseParallel()}
    if kind == "hf_qwen3":  # per-head norms on head-sharded activations: gradients reduced over tp
        plan.update({f"{a}.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True, reduce_grads=True),
                     f"{a}.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True, reduce_grads=True)})
    return plan


def _blocks(model: nn.Module):
    return list(model.layers.values()) if hasattr(model, "layers") else list(model.lm.model.layers)


def ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def parallel(kind: str, layout: str, variant: str):
    """(model, loss fn for compare_steps) for one case."""
    shape, names = MESHES[layout]
    mesh = cached_mesh(shape, names)
    model = build(kind)
    if "tp" in names:
        parallelize_module(model, mesh, tp_plan(kind), mesh_dim="tp")
    root = model.lm if kind != "llama" else model     # the HF model itself, not our logits wrapper
    apply_context_parallel(root, mesh, cp_dim="cp", variant=variant)
    cp_mesh = mesh["cp"]
    loss_group = cp_mesh
    if "dp" in names:   # FSDP2 over the flattened dp x cp mesh: cp ranks average their gradients there
        loss_group = mesh["dp", "cp"]._flatten("dp_cp")
        for block in _blocks(model):
            fully_shard(block, mesh=loss_group)
        fully_shard(model, mesh=loss_group)
    dp, dp_rank = (mesh["dp"].size(), mesh["dp"].get_local_rank()) if "dp" in names else (1, 0)

    def step(par, tokens, target):
        per = tokens.shape[0] // dp
        tokens, target = (t[dp_rank * per:(dp_rank + 1) * per] for t in (tokens, target))
        tok, tgt, _ = shard_batch(cp_mesh, tokens, target)
        loss = cp_cross_entropy(par(tok), tgt, loss_group)   # positions: filled in by ContextParallel
        loss.backward()
        if "dp" not in names:
            average_gradients(par, cp_mesh)
        return loss
    return model, step


def batches(seq: int, n: int = 1):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (BATCH, seq), generator=g), torch.randint(0, VOCAB, (BATCH, seq), generator=g))
            for _ in range(n)]


def check_cases(cases: list[tuple[str, str, str]], seq: int = 16) -> dict:
    """Per (model kind, layout, variant): (ok, ref losses, par losses, grad mismatches, missing grads)."""
    out = {}
    for kind, layout, variant in cases:
        ref = build(kind)
        par, step = parallel(kind, layout, variant)
        res = compare_steps(ref, par, batches(seq), ce, step)
        out[f"{kind}/{layout}/{variant}"] = (res.ok, res.ref_losses, res.par_losses, res.grad_mismatches[:4],
                                             res.missing_grads[:4])
    return out


def check_layout_and_loss_parallel(variant: str = "ring") -> dict:
    """unshard(shard(x)) == x with its gradient; cp x tp with loss parallel (vocabulary-sharded logits)."""
    mesh = cached_mesh((2, 2), ("cp", "tp"))
    cp_mesh = mesh["cp"]
    x = torch.randn(2, 16, 3, generator=torch.Generator().manual_seed(0)).requires_grad_()
    local = shard_sequence(x, 2, cp_mesh.get_local_rank(), 1)
    whole = unshard_sequence(local, cp_mesh)
    w = torch.arange(16.0).view(1, 16, 1)
    (whole * w).sum().backward()
    pos = shard_batch(cp_mesh, x.detach())[-1][0]
    expect = torch.zeros_like(x)
    expect[:, pos] = 2 * w[:, pos].expand(2, -1, 3)   # both cp ranks' losses reach this rank's chunks
    roundtrip = bool(torch.equal(whole.detach(), x.detach())) and bool(torch.allclose(x.grad, expect))

    ref = build("llama")
    par = build("llama")
    parallelize_module(par, mesh, EXPERT_PLANS["torchtitan"](), mesh_dim="tp")   # Shard(-1) logits
    apply_context_parallel(par, mesh, variant=variant)

    def step(model, tokens, target):
        tok, tgt, _ = shard_batch(mesh["cp"], tokens, target)
        with loss_parallel():
            loss = cp_cross_entropy(model(tok), tgt, mesh["cp"])
            loss.backward()
        average_gradients(model, mesh["cp"])
        return loss
    res = compare_steps(ref, par, batches(16), ce, step)
    return {"roundtrip": roundtrip,
            "loss_parallel": (res.ok, res.ref_losses, res.par_losses, res.grad_mismatches[:4], res.missing_grads[:4])}


def _snapshot(model: nn.Module):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {n: (m.__dict__.get("attention_kernel"), m.__dict__.get("_hp_cp_kernel"), m.__dict__.get("_hp_parallelized"),
                 len(m._forward_pre_hooks), len(m._forward_hooks))
             for n, m in model.named_modules()}
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return state, attrs, impl


def _same(a, b) -> bool:
    return a[1] == b[1] and a[2] == b[2] and a[0].keys() == b[0].keys() and all(
        torch.equal(a[0][k], b[0][k]) for k in a[0])


def check_errors() -> dict:
    """Each typed error, and whether the model was left exactly as it was."""
    mesh = cached_mesh((2, 2), ("x", "cp"))
    out = {}

    def attempt(name, model, fn, expected):
        before = _snapshot(model)
        try:
            fn()
            out[name] = ("no error", False)
        except expected as exc:
            out[name] = (type(exc).__name__ + ": " + str(exc)[:160], _same(before, _snapshot(model)))

    llama = build("llama")
    attempt("wrong mesh dim", llama, lambda: apply_context_parallel(llama, mesh, cp_dim="sp"), MeshError)
    attempt("unknown variant", llama, lambda: apply_context_parallel(llama, mesh, variant="zigzag"), StyleSpecError)
    tokens = torch.randint(0, VOCAB, (2, 10))
    attempt("seq not divisible (shard_batch)", llama, lambda: shard_batch(mesh["cp"], tokens), DivisibilityError)
    hf = HFLogits("hf_llama")
    hf.lm.config.is_causal = False
    attempt("non-causal model", hf.lm, lambda: apply_context_parallel(hf.lm, mesh), LayoutError)
    hf2 = HFLogits("hf_llama")
    apply_context_parallel(hf2.lm, mesh)
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[0, :2] = 0
    attempt("padding mask", hf2.lm, lambda: hf2.lm(input_ids=tokens[:, :8], attention_mask=pad), LayoutError)
    attempt("odd local length", llama,
            lambda: (apply_context_parallel(llama, mesh), llama(torch.randint(0, VOCAB, (2, 7)))), DivisibilityError)
    out["odd local length"] = (out["odd local length"][0], True)  # applied on purpose; the forward refused
    tied = build_llama(seed=3, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden=64,
                       max_seq_len=32, tie_embeddings=True)   # a later style of the same call fails in apply
    plan = {"": ContextParallel(), "tok_embeddings": ColwiseParallel(), "output": ColwiseParallel()}  # S(1) vs S(0)
    attempt("rollback after a later style fails", tied,
            lambda: parallelize_module(tied, mesh, plan, mesh_dim="cp"), StyleSpecError)
    return out
