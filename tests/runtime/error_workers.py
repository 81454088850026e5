"""Rank functions for the error tests."""
import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.models import build_llama
from hyper_parallel import PrepareModuleInput, Replicate, SequenceParallel, Shard, parallelize_module
from hyper_parallel.local import cached_mesh


def runtime_errors():
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    out = {}
    model = build_llama(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64)
    parallelize_module(model, mesh, {"layers.0.attention": PrepareModuleInput(
        input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate()))})
    try:
        model.layers["0"].attention(torch.randn(2, 8, 32))  # rope not passed
    except Exception as e:  # noqa: BLE001
        out["count"] = f"{type(e).__name__}: {e}"
    norm = nn.Sequential(nn.LayerNorm(32))
    parallelize_module(norm, mesh, {"": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
                                    "0": SequenceParallel()})
    try:
        norm(torch.randn(2, 9, 32))  # 9 divides neither 2 nor 4
    except Exception as e:  # noqa: BLE001
        out["divide"] = f"{type(e).__name__}: {e}"
    return out


def ping():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank()
