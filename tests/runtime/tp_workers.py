"""Functions run on every rank of a RankPool by the tensor-parallel tests."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel import loss_parallel, parallelize_module
from hyper_parallel.local import cached_mesh
from hyper_parallel.testing.compare import compare_steps

SMALL = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=32)


def ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(n: int, batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def par_loss(loss_parallel_on: bool):
    def fn(model, tokens, target):
        logits = model(tokens)
        if loss_parallel_on:
            with loss_parallel():
                loss = ce(logits, target)
                loss.backward()
        else:
            loss = ce(logits, target)
            loss.backward()
        return loss
    return fn


def check_expert_plans(plan_names: list[str], tied_options=(False, True), steps: int = 2):
    """Each named expert plan on the world mesh vs one device; returns {case: report}."""
    world = dist.get_world_size()
    mesh = cached_mesh((world,), ("tp",))
    reports = {}
    for name in plan_names:
        for tied in tied_options:
            ref = build_llama(seed=3, tie_embeddings=tied, **SMALL)
            par = build_llama(seed=3, tie_embeddings=tied, **SMALL)
            parallelize_module(par, mesh, EXPERT_PLANS[name]())
            if tied:
                assert par.output.weight is par.tok_embeddings.weight, "tied weight split in two"
            res = compare_steps(ref, par, batches(steps), ce, par_loss("loss_parallel" in name or name == "torchtitan"))
            reports[f"{name}/tied={tied}"] = (res.ok, res.ref_losses, res.par_losses,
                                             res.grad_mismatches[:5], res.missing_grads[:5])
    return reports


def llama_plan_counts(plan_name: str, n_layers: int = 2, device: str = "cpu", mesh=None):
    """Per-module collective counts of one training forward+backward of the Llama under a plan."""
    from hyper_parallel.testing.comm_counts import count_collectives

    world = dist.get_world_size()
    mesh = mesh or cached_mesh((world,), ("tp",))
    cfg = dict(SMALL, n_layers=n_layers)
    if world > 4:  # every sharded dim must divide the world size
        cfg.update(dim=8 * world, n_heads=world, n_kv_heads=world, vocab_size=2 * world,
                   ffn_hidden=2 * world, max_seq_len=world)
    model = build_llama(seed=0, device=device, **cfg)
    parallelize_module(model, mesh, EXPERT_PLANS[plan_name]())
    seq = min(16, cfg["max_seq_len"]) if world <= 4 else world
    with torch.device(device):
        tokens = torch.randint(0, cfg["vocab_size"], (2, seq)) if device != "meta" else \
            torch.empty(2, seq, dtype=torch.long)
    lp = "loss_parallel" in plan_name or plan_name == "torchtitan"

    def step():
        par_loss(lp)(model, tokens, tokens)

    return count_collectives(model, step)
