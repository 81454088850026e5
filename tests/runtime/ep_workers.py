"""Rank functions for tests/runtime/test_expert_parallel.py: HF MoE models (Mixtral, Qwen3-MoE,
DeepSeek-V3 with MLA + shared experts + a dense first layer, GPT-OSS) and the repo MoE model,
their experts split by ExpertParallel, one training step compared with one device.

Tokens: the global batch is split over the token-sharding mesh dimensions (``ep`` always, ``dp``
when present; ``tp`` ranks share tokens); each rank's loss is its shard's mean divided by the
number of shards, and gradients are summed the way a data-parallel wrapper would: non-expert
parameters over every token-sharding dimension, expert parameters over all but ``ep`` (the
all-to-alls already brought them every ep rank's tokens).
"""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from autoplan.models.moe import MoE, MoEConfig, build_moe
from hyper_parallel import ColwiseParallel, ExpertParallel, RowwiseParallel, balanced_routing, parallelize_module
from hyper_parallel.core.collective import merged_rows
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.core.expert_parallel import balanced_assignment
from hyper_parallel.errors import LayoutError, UnsupportedModuleError
from hyper_parallel.local import CollectiveRecorder, cached_mesh, fake_world, grads_by_name

VOCAB, BATCH, SEQ = 64, 4, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
HF_EXPERTS = "model.layers.*.mlp.experts"
REPO_EXPERTS = "layers.*.feed_forward.experts"

# case name -> (mesh shape, dim names, token-sharding dims, tp dim, split_tokens)
MESHES = {
    "ep2": ((2, 2), ("rep", "ep"), ("ep",), None, False),      # two independent ep=2 groups, same tokens
    "ep4": ((4,), ("ep",), ("ep",), None, False),
    "ep2xtp2": ((2, 2), ("ep", "tp"), ("ep",), "tp", False),
    "dp2xep2": ((2, 2), ("dp", "ep"), ("dp", "ep"), None, False),
    "dp2xep2xtp2": ((2, 2, 2), ("dp", "ep", "tp"), ("dp", "ep"), "tp", False),
    "ep4split": ((4,), ("ep",), (), None, True),                # ep borrowing from tp: every rank the same tokens
    "ep2xtp2attn": ((2, 2), ("ep", "tp"), ("ep",), "tp", False),  # + attention TP in the same plan
}
ATTENTION_TP = {**{f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
                "model.layers.*.self_attn.o_proj": RowwiseParallel()}


def build(name: str, seed: int = 0, n_experts: int = 8) -> tuple[nn.Module, str]:
    """(model with every parameter perturbed, experts pattern); identical on every rank."""
    torch.manual_seed(seed)
    if name.startswith("repo"):
        layout = "list" if name == "repo_list" else "stacked"
        model, pattern = build_moe(seed, layout=layout, n_experts=n_experts, first_moe_layer=1), REPO_EXPERTS
    else:
        model, pattern = _hf(name, n_experts), HF_EXPERTS
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model, pattern


def _hf(name: str, n_experts: int) -> nn.Module:
    import transformers as tf

    if name == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, intermediate_size=16, num_local_experts=n_experts, num_experts_per_tok=2,
                               router_jitter_noise=0.0)
        return tf.MixtralForCausalLM(cfg)
    if name in ("qwen3_moe", "qwen3_moe_tied"):   # _tied: the LM head tied to the embedding
        cfg = tf.Qwen3MoeConfig(**COMMON, tie_word_embeddings=name.endswith("_tied"), head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                num_experts=n_experts, num_experts_per_tok=2, norm_topk_prob=True)
        return tf.Qwen3MoeForCausalLM(cfg)
    if name == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64,
                                  moe_intermediate_size=16, n_routed_experts=n_experts, n_shared_experts=1,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=8)
        return tf.DeepseekV3ForCausalLM(cfg)
    if name == "gpt_oss":
        cfg = tf.GptOssConfig(**COMMON, head_dim=8, intermediate_size=16, num_local_experts=n_experts,
                              num_experts_per_tok=2, sliding_window=8)
        return tf.GptOssForCausalLM(cfg)
    raise ValueError(name)


def logits(model, tokens):
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


AUX_MODELS = ("mixtral", "repo", "repo_list")


def loss_with_aux(model, tokens, target, aux: bool):
    """Cross-entropy, plus 0.01 x the router's load-balancing loss when ``aux``."""
    if not aux:
        return ce(logits(model, tokens), target)
    if hasattr(model, "aux_loss"):  # the repo model
        return ce(model(tokens), target) + 0.01 * model.aux_loss()
    out = model(tokens, output_router_logits=True)
    return ce(out.logits, target) + 0.01 * out.aux_loss


def ce(out, target):
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _coord(mesh, dims) -> tuple[int, int]:
    """(this rank's shard index over ``dims``, number of shards)."""
    idx, n = 0, 1
    for d in dims:
        size = mesh[d].size() if mesh.ndim > 1 else mesh.size()
        local = mesh[d].get_local_rank() if mesh.ndim > 1 else mesh.get_local_rank()
        idx, n = idx * size + local, n * size
    return idx, n


def _group(mesh, d):
    return mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group()


def _is_expert(name: str) -> bool:
    return ".experts." in name and "shared" not in name


def run_case(model_name: str, case: str) -> dict:
    """``model_name``: a name of ``build``, optionally ":<experts>" (e.g. "mixtral:6": 6 experts,
    which ep=4 splits 2, 2, 2, 0 and 16 routed copies per rank do not divide)."""
    shape, names, token_dims, tp_dim, split = MESHES[case]
    mesh = cached_mesh(shape, names)
    name, _, n_experts = model_name.partition(":")
    ref, pattern = build(name, n_experts=int(n_experts or 8))
    par, _ = build(name, n_experts=int(n_experts or 8))
    style = ExpertParallel(tp_dim=tp_dim, split_tokens=split)
    if case.endswith("attn"):  # one plan, one call on the tp dimension: ExpertParallel finds ep in the root mesh
        parallelize_module(par, mesh, {pattern: style, **ATTENTION_TP}, mesh_dim="tp", strict=True)
    else:
        parallelize_module(par, mesh, {pattern: style}, mesh_dim="ep", strict=True)
    g = torch.Generator().manual_seed(7)
    tokens, target = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    shard, n = _coord(mesh, token_dims)
    rows = slice(shard * BATCH // n, (shard + 1) * BATCH // n)

    # every rank sees every token (split_tokens): the load-balancing loss is a global one, so it joins in
    aux = split and name in AUX_MODELS
    ref_loss = loss_with_aux(ref, tokens, target, aux)
    ref_loss.backward()
    par_loss = loss_with_aux(par, tokens[rows], target[rows], aux) / n
    par_loss.backward()
    total = par_loss.detach().clone()
    for d in token_dims:
        dist.all_reduce(total, group=_group(mesh, d))
    with torch.no_grad():
        for name, p in par.named_parameters():
            if p.grad is None:
                continue
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            for d in token_dims:
                if not (_is_expert(name) and d == "ep"):
                    dist.all_reduce(grad, group=_group(mesh, d))
    g_par = grads_by_name(par)
    _fill_list_experts(par, ref, g_par, mesh)
    g_ref = grads_by_name(ref)
    bad = _mismatches(g_ref, g_par)
    rl, pl = float(ref_loss.detach()), float(total)
    sharded = sorted(n for n, p in par.named_parameters() if isinstance(p, DTensor) or p.is_meta)
    return {"loss_ok": math.isclose(rl, pl, rel_tol=1e-5), "losses": (rl, pl), "bad": bad[:6],
            "n_grads": len(g_ref), "n_sharded": len(sharded), "aux": aux}


def _fill_list_experts(par, ref, grads, mesh):
    """ModuleList experts live on their owner only (meta elsewhere): broadcast each owner's gradient."""
    ep_mesh = mesh["ep"] if mesh.ndim > 1 else mesh
    ranks = ep_mesh.mesh.flatten().tolist()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        if ".experts.mlps." not in name:
            continue
        index = int(name.split(".experts.mlps.")[1].split(".")[0])
        n_experts = len(_module(par, name.split(".experts.mlps.")[0] + ".experts").mlps)
        owner = ranks[index // -(-n_experts // len(ranks))]   # blocks of ceil(E / ep): routing.expert_blocks
        buf = grads[name] if name in grads else torch.zeros_like(ref_params[name])
        dist.broadcast(buf, src=owner, group=ep_mesh.get_group())
        grads[name] = buf


def _module(model, fqn):
    return model.get_submodule(fqn)


def run_fsdp(model_name: str) -> dict:
    """dp=2 x ep=2 with FSDP2 doing the data-parallel averaging: the experts fully_shard over dp, every
    decoder layer and the root over the flattened dp x ep mesh. FSDP averages expert gradients over dp
    only while each already sums the tokens of its ep group, so they are divided by ep after backward
    (on NCCL: ``experts.set_gradient_divide_factor(dp * ep)``; gloo has no PREMUL_SUM)."""
    mesh = cached_mesh((2, 2), ("dp", "ep"))
    ref, pattern = build(model_name)
    par, _ = build(model_name)
    parallelize_module(par, mesh, {pattern: ExpertParallel()}, mesh_dim="ep", strict=True)
    flat = mesh["dp", "ep"]._flatten("dp_ep")
    for _, experts in match_modules(par, pattern):
        fully_shard(experts, mesh=mesh["dp"])
    for name, layer in par.named_modules():
        if re.search(r"(^|\.)layers\.\d+$", name):
            fully_shard(layer, mesh=flat)
    fully_shard(par, mesh=flat)
    g = torch.Generator().manual_seed(7)
    tokens, target = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    shard, n = _coord(mesh, ("dp", "ep"))
    rows = slice(shard * BATCH // n, (shard + 1) * BATCH // n)
    ref_loss = ce(logits(ref, tokens), target)
    ref_loss.backward()
    par_loss = ce(logits(par, tokens[rows]), target[rows])
    par_loss.backward()
    with torch.no_grad():
        for name, p in par.named_parameters():
            if _is_expert(name):
                p.grad.div_(mesh["ep"].size())
        total = par_loss.detach().clone()
        dist.all_reduce(total)
    bad = _mismatches(grads_by_name(ref), grads_by_name(par))
    experts = [p for n, p in par.named_parameters() if _is_expert(n)]
    return {"loss_ok": math.isclose(float(ref_loss.detach()), float(total) / n, rel_tol=1e-5), "bad": bad[:6],
            "expert_mesh_dims": sorted({p.device_mesh.mesh_dim_names for p in experts})}


def _mismatches(g_ref: dict, g_par: dict) -> list[str]:
    bad = []
    for name, gr in g_ref.items():
        gp = g_par.get(name)
        if gp is None:
            bad.append(f"{name}: missing")
        elif not torch.allclose(gp, gr, rtol=1e-4, atol=1e-6):
            bad.append(f"{name}: max err {(gp - gr).abs().max().item():.3g} (max |g| {gr.abs().max().item():.3g})")
    return bad


def check_all(cases: list[tuple[str, str]], extras: bool = True) -> dict:
    """Every (model, mesh case); with ``extras`` (4 ranks) also the error and balanced-routing checks."""
    out = {"errors": check_errors(), "balanced": check_balanced(),
           "fsdp": {m: run_fsdp(m) for m in ("mixtral", "repo")}} if extras else {}
    for model_name, case in cases:
        try:
            out[f"{model_name}/{case}"] = run_case(model_name, case)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            out[f"{model_name}/{case}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def check_balanced() -> dict:
    """Under balanced_routing() an ep=4 MoE layer computes its own experts on the balanced
    assignment (router weights kept): compared with the unsharded experts called on it."""
    mesh = cached_mesh((4,), ("ep",))
    cfg = MoEConfig(n_experts=8, top_k=2)
    torch.manual_seed(0)
    ref = MoE(cfg)
    torch.manual_seed(0)
    par = MoE(cfg)
    parallelize_module(par, mesh, {"experts": ExpertParallel()})
    x = torch.randn(2, 8, cfg.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    h = x.reshape(-1, cfg.dim)
    weights, _ = F.softmax(ref.router(h), dim=-1).topk(cfg.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    index = balanced_assignment(h.shape[0], cfg.top_k, cfg.n_experts)
    want = ref.experts(h, index, weights) + ref.shared_expert(h)
    with balanced_routing():
        got = par(x).reshape(-1, cfg.dim)
    counts = torch.bincount(index.reshape(-1), minlength=cfg.n_experts).tolist()
    return {"close": torch.allclose(got, want, rtol=1e-5, atol=1e-6), "counts": counts}


def check_errors() -> dict:
    """Typed errors, model unchanged: a Linear, a ModuleList with tp."""
    out = {}
    mesh = cached_mesh((4,), ("ep",))
    model, pattern = build("mixtral")
    out["wrong_module"] = _refused(model, mesh, {"model.layers.*.mlp.gate": ExpertParallel()}, UnsupportedModuleError)
    mesh2 = cached_mesh((2, 2), ("ep", "tp"))
    model, pattern = build("repo_list")
    out["list_tp"] = _refused(model, mesh2, {pattern: ExpertParallel(tp_dim="tp")}, UnsupportedModuleError,
                              mesh_dim="ep")
    return out


def _refused(model, mesh, plan, error, **kw) -> dict:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        parallelize_module(model, mesh, plan, **kw)
        message = None
    except error as exc:
        message = str(exc)
    unchanged = all(not isinstance(p, DTensor) and not p.is_meta and torch.equal(p, before[n])
                    for n, p in model.named_parameters())
    forwards = [m for m in model.modules() if "forward" in m.__dict__]
    return {"message": message, "unchanged": unchanged and not forwards}


def dry_run_collectives(world: int, shape: tuple, names: tuple, tp_dim: str | None, n_experts: int,
                        batch: int, seq: int, split_tokens: bool = False) -> tuple[list, list]:
    """(issued, predicted) rows {kind, dim, phase, bytes, count} for one forward+backward of one
    repo MoE layer under balanced routing, on the fake process group at ``world`` ranks, the way
    verify's dry run runs a plan: sharded on meta, then stepped under FakeTensorMode."""
    cfg = MoEConfig(dim=32, moe_hidden=16, n_experts=n_experts, top_k=2)
    with fake_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = {mesh.get_group(n).group_name: n for n in names}
        with torch.device("meta"):
            layer = MoE(cfg)
        style = ExpertParallel(tp_dim=tp_dim, split_tokens=split_tokens)
        parallelize_module(layer, mesh, {"experts": style}, mesh_dim="ep")
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer.to_empty(device="cpu")
            x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
            with pytest.raises(LayoutError, match="balanced_routing"):
                layer(x)
            with balanced_routing(), CollectiveRecorder() as rec:
                layer(x).sum().backward()
        issued = Counter((e["kind"], groups.get(e["group"], e["group"]), e["phase"], e["bytes"]) for e in rec.events)
        ep = mesh["ep"].size()
        tp = mesh[tp_dim].size() if tp_dim else 1
        predicted = style.predicted_collectives(tokens=batch * seq, hidden=cfg.dim, ffn=cfg.moe_hidden,
                                                top_k=cfg.top_k, experts=n_experts, dtype_bytes=4, ep=ep, tp=tp)
    issued_rows = sorted(({"kind": k, "mesh_dim": d, "phase": p, "bytes": b, "count": n}
                          for (k, d, p, b), n in issued.items()), key=lambda r: (r["kind"], r["mesh_dim"],
                                                                                  r["phase"], r["bytes"]))
    return issued_rows, merged_rows(predicted)


def hf_dry_run(name: str, world: int = 64, shape=(8, 4, 2)) -> tuple[dict, dict]:
    """(issued, predicted x MoE layers) {(kind, dim, phase, bytes): count} for one step of a whole
    HF MoE model, sharded on meta and stepped under FakeTensorMode on a fake dp x ep x tp world."""
    names = ("dp", "ep", "tp")
    with fake_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = {mesh.get_group(n).group_name: n for n in names}
        with torch.device("meta"):
            model = _hf(name, 8)
        style = ExpertParallel(tp_dim="tp")
        parallelize_module(model, mesh, {HF_EXPERTS: style}, mesh_dim="ep", strict=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            with balanced_routing(), CollectiveRecorder() as rec:
                model(torch.randint(0, VOCAB, (2, 8))).logits.sum().backward()
    issued = Counter((e["kind"], groups.get(e["group"], e["group"]), e["phase"], e["bytes"]) for e in rec.events)
    layers = sum(1 for n, _ in model.named_modules() if n.endswith("mlp.experts"))
    predicted = Counter()
    for c in style.predicted_collectives(tokens=16, hidden=COMMON["hidden_size"], ffn=16, top_k=2, experts=8,
                                         dtype_bytes=4, ep=shape[1], tp=shape[2]):
        predicted[c.kind, c.dim, c.phase, c.nbytes] += c.count * layers
    return dict(issued), dict(predicted)
