"""The kernels a cluster plan's price rests on, at the shapes one rank runs them: what
``autoplan profile --kernels`` measures on a device so that its efficiencies replace the datasheet
curves where the plans spend their time.

Read from what the search prices, not listed: the captured model's GEMMs and fused-attention ops
(``unit_work``: each distinct op once, its M, N, K and, for attention, the fraction of the scores its
mask computes), each weight GEMM narrowed to the rank's tensor-parallel shard as the pricing narrows
it (``cost_models.compute.sharded_gemm_dims``), and the MoE layers' grouped expert GEMMs at the rows an
expert receives under expert parallelism (``experts.search.expert_gemm_shapes``).
"""
from __future__ import annotations

from autoplan.capture.views import module_summary
from autoplan.search.experts.search import expert_gemm_shapes
from autoplan.search.units.work import module_work
from cost_models.compute import ATTENTION, ATTENTION_CAUSAL, keys_per_query, sharded_gemm_dims
from cost_models.kernel_efficiency import KernelShape


def priced_kernels(search, *, b: int, tp: int = 1, ep: int = 1, cp: int = 1, note: str = "") -> list[KernelShape]:
    """Every distinct kernel shape ``search`` (a ``ClusterSearch``) prices for one rank at
    micro-batch ``b`` on a mesh with tensor-parallel degree ``tp`` and expert-parallel degree
    ``ep`` (``cp``: the sequence shard each rank holds). Attention heads are counted whole (a
    tensor-parallel shard divides the heads, which the measured efficiency does not depend on);
    non-causal attention (cross-attention, encoders) is left out -- the kernels measure causal
    self-attention."""
    graph = search.graph(b, cp)
    rows = {r["fqn"]: r for r in module_summary(graph).to_dict("records")}
    work = module_work(graph, "", rows)
    out: dict[tuple, KernelShape] = {}
    for f, m, n, k, *split in work.gemms:
        tag = split[0] if split else ""
        if tag in (ATTENTION, ATTENTION_CAUSAL):
            if tag != ATTENTION_CAUSAL or m != n:
                continue
            density = split[1] if len(split) > 1 else 0.5
            heads = max(1, round(f / KernelShape("attention", int(m), int(n), int(k)).full_flops()))
            window = max(1, round(keys_per_query(m, density))) if density < 0.5 else 0   # 0: every earlier key
            shape = KernelShape("attention", int(m), int(n), int(k), groups=heads, window=window, note=note)
        else:
            sm, sn, sk = sharded_gemm_dims(m, n, k, tag, tp)
            shape = KernelShape("gemm", int(sm), max(1, round(sn)), max(1, round(sk)), note=note)
        out.setdefault((shape.kind, shape.m, shape.n, shape.k, shape.window), shape)
    for group in (search.moe_groups_at(b, cp) if search.moe_groups else []):
        for m, n, k, local in expert_gemm_shapes(group, tokens=b * search.seq // cp, ep=ep, etp=1):
            shape = KernelShape("grouped_gemm", max(1, round(m)), int(n), int(k), groups=local, note=note)
            out.setdefault((shape.kind, shape.m, shape.n, shape.k, shape.groups), shape)
    return list(out.values())
