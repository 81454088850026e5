"""Functions the cost_models tests run on every rank of a RankPool (must be importable)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.models import build_llama
from hyper_parallel.local import cached_mesh

# odd vocabulary so the vocab-sharded embedding and output split unevenly across ranks
SMALL = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=129, ffn_hidden=96, max_seq_len=32)

# the torchtitan Llama-3 plan (shared/reference/expert_plans.json), by style name, for the cost model
TORCHTITAN_STYLES = {
    "tok_embeddings": "rowwise", "norm": "sequence_parallel", "output": "colwise",
    "layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel",
    "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


def _torchtitan_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


MEGATRON_STYLES = {k: v for k, v in TORCHTITAN_STYLES.items() if v != "sequence_parallel"}


def _megatron_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
    }


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def measured_state_bytes() -> dict:
    """Apply the torchtitan TP plan with torch's parallelize_module, take one AdamW step, count bytes."""
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    mesh = cached_mesh((world,), ("tp",))
    model = build_llama(seed=0, **SMALL)
    parallelize_module(model, mesh, _torchtitan_plan())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g)
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return {"rank": dist.get_rank(), "params": params, "grads": grads, "optimizer": optim}


def measured_fsdp_state_bytes() -> dict:
    """fully_shard every block and the root over all ranks (fp32), one AdamW step; count bytes.

    Parameters and optimizer moments are counted by allocated storage (FSDP2 pads dim 0 to a
    multiple of the world size), gradients by their local shard.
    """
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = cached_mesh((world,), ("fsdp",))
    model = build_llama(seed=0, **SMALL)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    opt.step()

    def storage(t) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.untyped_storage().nbytes()

    params = sum(storage(p) for p in model.parameters())
    unpadded = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return {"rank": dist.get_rank(), "params": params, "params_unpadded": unpadded, "grads": grads, "optimizer": optim}


def measured_tp_block_activations(plan: str, batch: int = 2, seq: int = 16) -> dict:
    """Per-rank bytes each module of layers.0 saves for backward under a TP plan ("torchtitan": TP+SP,
    "megatron": TP without SP), plus the replicated RoPE table."""
    from torch.distributed.tensor.parallel import parallelize_module

    from cost_models.saved_bytes import saved_bytes_by_module

    world = dist.get_world_size()
    mesh = cached_mesh((world,), ("tp",))
    model = build_llama(seed=0, **SMALL)
    parallelize_module(model, mesh, _torchtitan_plan() if plan == "torchtitan" else _megatron_plan())
    tokens = torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    per, _ = saved_bytes_by_module(lambda: model(tokens), model)
    return {k: v for k, v in per.items() if k.startswith("layers.0") or k == "<replicated>"}
