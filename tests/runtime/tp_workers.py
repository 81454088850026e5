"""Functions run on every rank of a RankPool by the tensor-parallel tests."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel import loss_parallel, parallelize_module
from hyper_parallel.testing import cached_mesh
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
