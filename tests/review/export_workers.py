"""Rank functions for the export tests: the same plan applied three ways must train alike.

(1) hyper_parallel's parallelize_module with the plan's styles, (2) torch's own
parallelize_module with ``autoplan.review.to_torch`` styles, (3) the ``to_python`` snippet
executed as code; each against a one-device copy of the repo Llama.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

from autoplan.models import build_llama
from hyper_parallel import loss_parallel, parallelize_module, style_from_dict
from hyper_parallel.local import cached_mesh, full, grads_by_name

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=32)


def _step(model, tokens, target):
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
    return float(full(loss).detach()), full(logits).detach().float()


def apply_three_ways(styles: dict, snippet: str) -> dict:
    """Loss, logits and gradient agreement of the three applications vs one device."""
    from autoplan.review import to_torch

    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, MODEL["vocab_size"], (2, 17), generator=g)
    tokens, target = data[:, :-1], data[:, 1:]

    ref = build_llama(seed=0, **MODEL)
    loss_ref, logits_ref = _step(ref, tokens, target)
    g_ref = grads_by_name(ref)

    ours = build_llama(seed=0, **MODEL)
    parallelize_module(ours, mesh, {k: style_from_dict(v) for k, v in styles.items()})
    theirs = build_llama(seed=0, **MODEL)
    torch_parallelize(theirs, mesh, to_torch(styles, theirs))
    code = build_llama(seed=0, **MODEL)
    exec(compile(snippet, "<to_python>", "exec"), {"model": code, "device_type": "cpu"})  # noqa: S102

    out = {"loss_ref": loss_ref}
    for name, model in (("hyper_parallel", ours), ("torch", theirs), ("snippet", code)):
        loss, logits = _step(model, tokens, target)
        grads = grads_by_name(model)
        out[name] = {
            "loss": loss,
            "logits_ok": torch.allclose(logits, logits_ref, rtol=1e-5, atol=1e-6),
            "grad_bad": [n for n in g_ref if n not in grads
                         or not torch.allclose(grads[n], g_ref[n], rtol=1e-4, atol=1e-6)],
            "dtensor_params": sum(1 for p in model.parameters() if hasattr(p, "placements")),
        }
    return out
