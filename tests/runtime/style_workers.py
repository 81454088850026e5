"""Rank functions for the per-style tests: numerics, collective counts, torch parity."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

from hyper_parallel import parallelize_module
from hyper_parallel.core.tensor_parallel import to_torch_plan
from hyper_parallel.local import cached_mesh
from hyper_parallel.testing.comm_counts import count_collectives
from hyper_parallel.local import full, grads_by_name
from tests.runtime.style_cases import CASES, TORCH_CANNOT, build_case


def _fresh(x):
    """A private copy of a float input that requires grad, so input-gradient collectives run."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().clone().requires_grad_(True)
    return x


def _run(module, args, kwargs):
    out = module(*[_fresh(a) for a in args], **{k: _fresh(v) for k, v in kwargs.items()})
    loss = full(out).float().pow(2).sum()
    loss.backward()
    return full(out).detach()


def _counts_for(per_module, expected_keys):
    return {k: (per_module.get(k, {}).get("forward", {}), per_module.get(k, {}).get("backward", {}))
            for k in expected_keys}


def check_styles(names=None, with_torch: bool = True):
    """Per case: output/grad agreement with one device, our counts, and torch's (if asked)."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    report = {}
    for name in names or list(CASES):
        module, args, kwargs, plan, expected = build_case(name)
        ref = copy.deepcopy(module)
        out_ref = _run(ref, args, kwargs)
        g_ref = grads_by_name(ref)

        ours = copy.deepcopy(module)
        parallelize_module(ours, mesh, plan)
        holder = {}
        _, per = count_collectives(ours, lambda: holder.setdefault("out", _run(ours, args, kwargs)))
        g_ours = grads_by_name(ours)
        entry = {
            "out_ok": torch.allclose(holder["out"], out_ref, rtol=1e-5, atol=1e-6),
            "grad_bad": [n for n in g_ref if n not in g_ours or
                         not torch.allclose(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-6)],
            "counts": _counts_for(per, expected),
            "expected": expected,
            "dtensor_params": sorted(n for n, p in ours.named_parameters() if isinstance(p, DTensor)),
        }
        if with_torch and name not in TORCH_CANNOT:
            theirs = copy.deepcopy(module)
            torch_plan = to_torch_plan(plan, theirs)
            root_style = torch_plan.pop("", None)  # torch has no key for the root module
            if root_style is not None:
                torch_parallelize(theirs, mesh, root_style)
            torch_parallelize(theirs, mesh, torch_plan)
            holder_t = {}
            _, per_t = count_collectives(theirs, lambda: holder_t.setdefault("out", _run(theirs, args, kwargs)))
            g_t = grads_by_name(theirs)
            entry["torch_out_same"] = torch.allclose(holder_t["out"], holder["out"], rtol=1e-6, atol=1e-7)
            entry["torch_grad_diff"] = [n for n in g_t if not torch.allclose(g_t[n], g_ours[n], rtol=1e-5, atol=1e-7)]
            entry["torch_forward_counts"] = {k: v[0] for k, v in _counts_for(per_t, expected).items()}
            entry["torch_backward_counts"] = {k: v[1] for k, v in _counts_for(per_t, expected).items()}
        report[name] = entry
    return report
