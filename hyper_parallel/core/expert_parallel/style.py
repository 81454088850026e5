"""ExpertParallel: the experts of an MoE layer split over an ``ep`` mesh dimension.

Applied with ``parallelize_module`` to the *experts container* (``block.experts`` in
transformers' Mixtral / Qwen3-MoE / DeepSeek-V3 / GPT-OSS and the repo MoE model); the router
and shared experts are left to the other styles. Rank r of the ep group keeps the experts
``routing.expert_blocks`` gives it -- ``[r*L, min((r+1)*L, E))`` with ``L = ceil(E/ep)``, so ep
need not divide E (6 experts over ep=4: 2, 2, 2, 0) -- (3-D weights: a DTensor ``Shard(0)``, which
splits them the same way; a ModuleList: the other experts' parameters become meta tensors), and
the container's forward becomes: route every token copy to its expert's rank (all-to-all, counts
first; per-peer row counts, so no split needs to be even), run the local experts (one grouped
GEMM), send the outputs back (all-to-all), scale each copy by its routing weight and sum a
token's copies.

``ep_dim=""``: no expert parallelism -- every rank keeps every expert, split over ``tp_dim`` (or,
when None, over the mesh given: the tensor-parallel slice ``parallelize_module(..., mesh_dim=...)``
hands the other TP styles), the form transformers' ``moe_tp_experts`` plans and the planner uses
on a mesh without an ep dimension.

``tp_dim``: expert tensor parallelism inside each ep group (3-D weights only): gate_up is split
column-wise (each rank its slice of both the gate and the up half), down row-wise, and the
partial expert outputs are summed with one all-reduce over tp per layer (its backward: one
all-reduce of the input gradient).

Which tokens: every rank of an ep group must hold *different* tokens -- ep borrows from data
parallel (dp=2 x ep=2: four batch shards) -- and the ranks of a tp group the *same* tokens. The
caller then averages gradients over the token-sharding dimensions: non-expert parameters over
dp x ep, expert parameters over dp only (the all-to-alls already brought them every ep rank's
tokens). If the ranks of an ep group hold the same tokens (ep borrowing from tp), forward is
still right but expert gradients come out ep times too large -- unless ``split_tokens=True``: each
rank then takes its 1/ep slice of the tokens before dispatch and the outputs are all-gathered
after combine (one all-gather over ep forward, two -- hidden and routing-weight gradients --
backward), so no rank computes a token twice and no gradient needs rescaling.
"""
from __future__ import annotations

import logging

import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.core.collective import Collective
from hyper_parallel.core.expert_parallel.dispatch import (
    CopyToTP,
    GatherTokens,
    ReduceFromTP,
    SplitTokens,
    combine,
    dispatch,
)
from hyper_parallel.core.expert_parallel.layouts import ExpertsLayout, list_experts, read_layout, stacked_experts
from hyper_parallel.core.expert_parallel.predict import expert_parallel_collectives
from hyper_parallel.core.expert_parallel.routing import (
    balanced_assignment,
    balanced_counts,
    balanced_order,
    balanced_routing_active,
    expert_blocks,
)
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, shard_dims
from hyper_parallel.errors import DivisibilityError, LayoutError, MeshError, StyleSpecError, UnsupportedModuleError

log = logging.getLogger(__name__)


def _dims(mesh: DeviceMesh, ep_dim: str, tp_dim: str | None, where: str) -> tuple[DeviceMesh, DeviceMesh | None,
                                                                                  DeviceMesh]:
    """(ep mesh, tp mesh or None, the mesh expert weights live on) found by name in ``mesh`` or
    in the root mesh it was sliced from (parallelize_module hands styles a 1-D slice)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = root.mesh_dim_names or ()
    if not ep_dim:   # no expert parallelism: each expert split over tp_dim, or over the mesh given
        if tp_dim is not None and tp_dim not in names:
            raise MeshError(f"{where}: mesh dimension {tp_dim!r} not found; the mesh (root of the one given) has "
                            f"dimensions {names}")
        tp_mesh = root[tp_dim] if tp_dim is not None and root.ndim > 1 else mesh
        return None, tp_mesh, tp_mesh
    wanted = [d for d in (ep_dim, tp_dim) if d is not None]
    for d in wanted:
        if d not in names:
            if mesh.ndim == 1 and len(wanted) == 1 and mesh.mesh_dim_names in (None, (d,)):
                return mesh, None, mesh  # an unnamed (or exactly named) 1-D mesh is the ep mesh
            raise MeshError(f"{where}: mesh dimension {d!r} not found; the mesh (root of the one given) has "
                            f"dimensions {names}; pass a mesh with an {d!r} dimension or set ep_dim/tp_dim")
    if root.ndim == 1:
        return root, None, root
    ep_mesh = root[ep_dim]
    if tp_dim is None:
        return ep_mesh, None, ep_mesh
    ordered = tuple(d for d in names if d in (ep_dim, tp_dim))
    return ep_mesh, root[tp_dim], root[ordered]


def _local_order(top_k_index, num_experts: int, balanced: bool) -> tuple:
    """ep == 1: (token copies sorted by expert, rows per expert); from sizes alone when balanced."""
    copies = top_k_index.numel()
    if balanced:
        return balanced_order(copies, num_experts, top_k_index.device), balanced_counts(copies, num_experts)
    flat = top_k_index.reshape(-1)
    return flat.argsort(stable=True), flat.bincount(minlength=num_experts).tolist()


class ExpertParallel(ParallelStyle):
    """Expert parallelism (+ optional expert tensor parallelism) for an MoE experts container.

    ``ep_dim``: the mesh dimension the experts are split over ("": none). ``tp_dim``: the mesh dimension
    each expert's weights are split over (None: none). ``balanced``: always route by the
    deterministic balanced assignment (as inside ``balanced_routing()``; dry runs only).
    ``split_tokens``: the ranks of the ep group hold the same tokens (ep borrowing from tp); each
    dispatches its 1/ep slice and the outputs are all-gathered.
    """

    _args = {"ep_dim": "ep", "tp_dim": None, "balanced": False, "split_tokens": False}

    def __init__(self, *, ep_dim: str = "ep", tp_dim: str | None = None, balanced: bool = False,
                 split_tokens: bool = False):
        if not isinstance(ep_dim, str):
            raise StyleSpecError(f"ExpertParallel: ep_dim must be a mesh dimension name (or '' for none), "
                                 f"got {ep_dim!r}")
        if tp_dim is not None and (not isinstance(tp_dim, str) or not tp_dim or tp_dim == ep_dim):
            raise StyleSpecError(f"ExpertParallel: tp_dim must be None or a mesh dimension name other than "
                                 f"ep_dim={ep_dim!r}, got {tp_dim!r}")
        for name, value in (("balanced", balanced), ("split_tokens", split_tokens)):
            if not isinstance(value, bool):
                raise StyleSpecError(f"ExpertParallel: {name} must be a bool, got {value!r}")
        self.ep_dim, self.tp_dim, self.balanced, self.split_tokens = ep_dim, tp_dim, balanced, split_tokens

    # ---- checks ---------------------------------------------------------------------------------
    def _where(self, fqn: str) -> str:
        return f"ExpertParallel on {fqn or '<root>'}"

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> ExpertsLayout:
        where = self._where(fqn)
        layout = read_layout(module, where)
        ep_mesh, tp_mesh, _ = _dims(mesh, self.ep_dim, self.tp_dim, where)
        if tp_mesh is not None:
            if layout.kind != "stacked":
                raise UnsupportedModuleError(f"{where}: tp_dim={self.tp_dim!r} needs 3-D expert weights; "
                                             f"{type(module).__name__} holds a ModuleList (use tp_dim=None)")
            tp = tp_mesh.size()
            if layout.ffn % tp:
                raise DivisibilityError(f"{where}: the expert ffn width F = {layout.ffn} is not divisible by "
                                        f"{self.tp_dim} = {tp} (valid: tp sizes dividing {layout.ffn})")
        return layout

    # ---- application ----------------------------------------------------------------------------
    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = self._where(fqn)
        layout = self.check_module(module, mesh, fqn)
        ep_mesh, tp_mesh, param_mesh = _dims(mesh, self.ep_dim, self.tp_dim, where)
        ep = ep_mesh.size() if ep_mesh is not None else 1
        ep_rank = ep_mesh.get_local_rank() if ep_mesh is not None else 0
        first, local_n = expert_blocks(layout.num_experts, ep)[ep_rank]   # uneven when ep does not divide E
        if layout.kind == "stacked":
            for name, placements in self._placements(layout, param_mesh).items():
                param = module._parameters.get(name)
                if param is None:
                    continue
                new = record.sharded(param, placements, param_mesh, where=f"{fqn}.{name}")
                record.replace_param(module, name, new)
        else:
            experts = getattr(module, layout.list_name)
            for i, expert in enumerate(experts):
                if first <= i < first + local_n:
                    continue
                for sub in expert.modules():
                    for name, p in list(sub._parameters.items()):
                        if p is not None:
                            record.replace_param(sub, name, nn.Parameter(p.detach().to("meta"),
                                                                         requires_grad=p.requires_grad))
        ep_group = ep_mesh.get_group() if ep_mesh is not None else None
        tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        style = self

        def forward(hidden_states, top_k_index, top_k_weights, *rest, **kwargs):
            if style.split_tokens and ep > 1:
                if hidden_states.shape[0] % ep:
                    raise DivisibilityError(f"{where}: split_tokens needs the token count "
                                            f"{hidden_states.shape[0]} divisible by {style.ep_dim} = {ep}")
                hidden = SplitTokens.apply(hidden_states, ep_rank, ep, ep_group)
                weights = SplitTokens.apply(top_k_weights, ep_rank, ep, ep_group)
                index = top_k_index.chunk(ep, dim=0)[ep_rank]
                out = style._forward(module, layout, hidden, index, weights, ep, ep_rank, first, ep_group, tp_group)
                return GatherTokens.apply(out, ep_rank, ep, ep_group)
            return style._forward(module, layout, hidden_states, top_k_index, top_k_weights, ep, ep_rank, first,
                                  ep_group, tp_group)

        record.add_flag(module, "forward", forward)
        log.debug("%s: %d of %d experts per rank (%s), tp=%s", where, local_n, layout.num_experts, layout.kind,
                  tp_mesh.size() if tp_mesh is not None else 1)
        return module

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]] | None:
        """On a one-dimensional mesh (ep alone, or tp alone with ``ep_dim=""``): stacked weights'
        placements, their layout read from the shapes (transposed when gate_up_proj's middle
        dimension is the hidden width down_proj ends with). Two dimensions, or a ModuleList of
        experts, are not one placement per parameter: None."""
        gu, down = params.get("gate_up_proj"), params.get("down_proj")
        if (self.ep_dim and self.tp_dim is not None) or gu is None or down is None or len(gu) != 3 or len(down) != 3:
            return None
        transposed = gu[1] == down[2] and gu[2] == 2 * down[1]
        h, two_f = (gu[1], gu[2]) if transposed else (gu[2], gu[1])
        layout = ExpertsLayout("stacked", gu[0], h, two_f // 2, transposed)
        return shard_dims({n: p[0] for n, p in self._placements(layout, None).items() if n in params})

    def _placements(self, layout: ExpertsLayout, param_mesh: DeviceMesh | None) -> dict[str, tuple]:
        """Per parameter: its placements on the (ep[, tp]) weight mesh."""
        if self.tp_dim is None and self.ep_dim:
            return {n: (Shard(0),) for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")}
        out_dim, in_dim = (2, 1) if layout.transposed else (1, 2)
        # [gate|up] halves: each tp rank takes its slice of both; interleaved pairs stay whole in a chunk
        col = (lambda d: _StridedShard(d, split_factor=2)) if layout.concatenated else Shard
        tp_part = {"gate_up_proj": col(out_dim), "down_proj": Shard(in_dim), "gate_up_proj_bias": col(1),
                   "down_proj_bias": Replicate()}
        if not self.ep_dim:
            return {n: (p,) for n, p in tp_part.items()}
        ep_first = param_mesh.mesh_dim_names[0] == self.ep_dim
        return {n: ((Shard(0), p) if ep_first else (p, Shard(0))) for n, p in tp_part.items()}

    def _forward(self, module, layout, hidden, top_k_index, top_k_weights, ep, ep_rank, first, ep_group, tp_group):
        tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
        balanced = self.balanced or balanced_routing_active()
        if balanced:
            top_k_index = balanced_assignment(tokens, top_k, layout.num_experts, hidden.device)
        elif hidden.is_meta or is_fake(hidden):
            raise LayoutError(f"ExpertParallel on {type(module).__name__}: the all-to-all sizes depend on the routing, "
                              f"which meta/fake tensors do not have; run dry runs inside balanced_routing() "
                              f"(or with ExpertParallel(balanced=True))")
        if ep > 1:
            rows, info = dispatch(hidden, top_k_index, layout.num_experts, ep, ep_group, balanced, ep_rank)
            counts = info.local_counts
        else:
            info = None
            order, counts = _local_order(top_k_index, layout.num_experts, balanced)
            rows = hidden[order // top_k]
        if layout.kind == "stacked":
            if tp_group is not None:
                rows = CopyToTP.apply(rows, tp_group)
                reduce = lambda t: ReduceFromTP.apply(t, tp_group)  # noqa: E731
            else:
                reduce = None
            out = stacked_experts(module, layout, rows, counts, reduce)
        else:
            out = list_experts(module, layout, first, rows, counts)
        if info is not None:
            return combine(out, info, top_k_weights, tokens, ep_group, hidden.dtype)
        weights = top_k_weights.reshape(-1)[order]
        final = hidden.new_zeros(tokens, out.shape[-1])
        return final.index_add(0, order // top_k, (out * weights[:, None]).to(hidden.dtype))

    # ---- predictions ----------------------------------------------------------------------------
    def predicted_collectives(self, *, tokens: int, hidden: int, ffn: int, top_k: int, experts: int,
                              dtype_bytes: int, ep: int, tp: int = 1,
                              weight_bytes: int | None = None) -> list[Collective]:
        """The collectives this style issues per MoE layer per training step under balanced
        routing (see :func:`expert_parallel_collectives`)."""
        return expert_parallel_collectives(self, tokens=tokens, hidden=hidden, ffn=ffn, top_k=top_k,
                                           experts=experts, dtype_bytes=dtype_bytes, ep=ep, tp=tp,
                                           weight_bytes=weight_bytes)
