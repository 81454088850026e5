"""Exact per-rank parameter shards and FSDP traffic of a chosen plan.

The ILP prices parameter bytes per unit; a plan's predictions must instead match what the
runtime does byte for byte. DTensor shards a dimension in ``ceil(n / t)`` chunks (rank 0 holds
a full chunk); FSDP2 then shards dim 0 of each rank's tensor over dp, padding it to a multiple
of dp, and moves each FSDP unit's parameters in one all-gather / reduce-scatter of the padded
size. FSDP units are what the runner wraps: every repeated block, then the root with the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.capture.ir import ModelGraph, dtype_size
from hyper_parallel.core.tensor_parallel.base import ParallelStyle
from hyper_parallel.core.tensor_parallel.linear_styles import CONV1D
from hyper_parallel.core.style_registry import style_from_dict
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.fqn_pattern import fqn_matches, wildcards

_LINEAR = "torch.nn.modules.linear.Linear"
_EMBEDDING = "torch.nn.modules.sparse.Embedding"


def _layer(info) -> str:
    """The torch.nn layer a module is an instance of (subclasses included), else its type."""
    return info.nn_base or info.type


def _shard_dim(style: str, module_type: str, param: str) -> int | None:
    if module_type == CONV1D:   # weight [in, out]: the Linear's dims swapped; bias as Linear's
        dim = _shard_dim(style, _LINEAR, param)
        return dim if param != "weight" or dim is None else 1 - dim
    if style == "ColwiseParallel":
        if module_type == _LINEAR:
            return 0
        if module_type == _EMBEDDING:
            return 1
    if style == "RowwiseParallel":
        if module_type == _LINEAR:
            return 1 if param == "weight" else None
        if module_type == _EMBEDDING:
            return 0
    return None


@dataclass
class ParamShard:
    fqn: str
    unit: str            # FSDP unit: a block FQN or "" (root)
    local_shape: tuple[int, ...]   # after tensor parallel, rank 0
    dtype_bytes: int
    # the dimension FSDP2 shards: 0, or 1 for a weight strided-sharded on dim 0 by a packed
    # projection (hyper_parallel.core.dtensor.fsdp_shard_placement, what the runners pass); None
    # for a packed projection's bias, which FSDP leaves replicated (fsdp_unshardable): its
    # gradient is all-reduced over dp after backward
    fsdp_dim: int | None = 0
    # the experts container ExpertParallel splits this parameter with ("" otherwise): FSDP wraps
    # it as its own unit over dp, while every other parameter is sharded over dp x ep
    # (autoplan.parallelisms.data.state_mesh)
    experts: str = ""

    def fsdp_degree(self, dp: int, ep: int) -> int:
        """Ranks FSDP shards this parameter over: dp for an expert weight, dp x ep otherwise."""
        return dp if self.experts else dp * ep

    def fsdp_local_numel(self, dp: int) -> int:
        if not self.local_shape:
            return 1
        if self.fsdp_dim is None:
            return math.prod(self.local_shape)
        d = self.local_shape[self.fsdp_dim]
        return math.ceil(d / dp) * math.prod(self.local_shape) // max(d, 1)

    def fsdp_padded_numel(self, dp: int) -> int:
        return self.fsdp_local_numel(dp) * dp


def param_shards(graph: ModelGraph, styles: dict[str, dict], tp: int, block_prefixes: list[str]) -> list[ParamShard]:
    """Every parameter (ties counted once, at its first FQN) with its rank-0 TP-local shape."""
    canonical, members = {}, {}
    for group in graph.tied_parameters:
        members[group[0]] = list(group)
        for name in group:
            canonical[name] = group[0]
    owner_style: dict[str, str] = {}
    owner_packed: dict[str, int] = {}
    for fqn in graph.modules:
        best = None
        for pattern, spec in styles.items():
            if fqn_matches(pattern, fqn):
                wild = wildcards(pattern)
                if best is None or wild < best[0]:
                    best = (wild, spec["style"], spec)
        if best:
            owner_style[fqn] = best[1]
            owner_packed[fqn] = int((best[2].get("args") or {}).get("packed", 1))
    own_dims = _style_shard_dims(graph, styles)
    out, seen = [], set()
    dtype_bytes = _param_dtype_bytes(graph)
    for fqn, info in sorted(graph.modules.items()):
        for pname, shape in info.params.items():
            full = f"{fqn}.{pname}" if fqn else pname
            full = canonical.get(full, full)
            if full in seen:
                continue
            seen.add(full)
            # a tied parameter is laid out by whichever of its holders a style shards it through
            # (BERT's decoder bias, first named after cls.predictions, which only holds it)
            owner, dim = full.rsplit(".", 1)[0] if "." in full else "", None
            for name in members.get(full, [full]):
                o = name.rsplit(".", 1)[0] if "." in name else ""
                mtype = _layer(graph.modules[o]) if o in graph.modules else _layer(info)
                d = _shard_dim(owner_style.get(o, ""), mtype, name.rsplit(".", 1)[-1])
                if d is not None:
                    owner, dim = o, d
                    break
            packed = owner_packed.get(owner, 1) > 1
            if full in own_dims:   # a style that shards its parameters its own way says how
                dim, packed = own_dims[full]
            local = list(shape)
            if dim is not None and tp > 1:
                local[dim] = math.ceil(local[dim] / tp)
            strided_rows = dim == 0 and tp > 1 and packed and len(shape) > 1
            unit = next((f"{p}.{rest.split('.')[0]}" for p in block_prefixes
                         if full.startswith(p + ".") and (rest := full[len(p) + 1:]).count(".") >= 1), "")
            strided_bias = dim == 0 and tp > 1 and packed and len(shape) == 1
            out.append(ParamShard(full, unit, tuple(local), dtype_bytes,
                                  None if strided_bias else 1 if strided_rows else 0))
    return out


def _style_shard_dims(graph: ModelGraph, styles: dict[str, dict]) -> dict[str, tuple[int, bool]]:
    """{parameter FQN: (dim, strided)} for the parameters under each module whose style says how it
    shards them (``ParallelStyle.param_shard_dims``: experts, Mamba mixers), from the shapes the
    capture recorded; the styles that do not say are read by layer type in :func:`_shard_dim`."""
    out: dict[str, tuple[int, bool]] = {}
    built: dict[str, object] = {}
    for pattern, spec in styles.items():
        key = repr(sorted(spec.items()))
        style = built.get(key) or built.setdefault(key, style_from_dict(spec))
        if type(style).param_shard_dims is ParallelStyle.param_shard_dims:
            continue
        for fqn in graph.modules:
            if not fqn_matches(pattern, fqn):
                continue
            params = {(f"{m.fqn[len(fqn) + 1:]}." if m.fqn != fqn else "") + name: shape
                      for m in graph.modules_under(fqn) for name, shape in m.params.items()}
            for path, dims in (style.param_shard_dims(params) or {}).items():
                out[f"{fqn}.{path}" if fqn else path] = dims
    return out


def _param_dtype_bytes(graph: ModelGraph) -> int:
    for n in graph.nodes:
        for t in n.inputs:
            if "float" in t.dtype or "bfloat" in t.dtype:
                return dtype_size(t.dtype)
    return 4


def rank_param_bytes(shards: list[ParamShard], dp: int, fsdp: bool, ep: int = 1) -> int:
    """Parameter bytes on rank 0 (``ep``: the ep degree FSDP shards non-expert parameters over too)."""
    return sum(s.fsdp_local_numel(s.fsdp_degree(dp, ep) if fsdp else 1) * s.dtype_bytes for s in shards)


def fsdp_units(shards: list[ParamShard], dp: int, dp_dim: str, ep: int = 1, state_dim: str | None = None
               ) -> tuple[dict[tuple[str, str], int], int]:
    """FSDP2's units as the runners wrap them: {(mesh dim, unit): padded bytes} -- every block and
    the root (unit "") over ``state_dim`` (the flattened dp x ep mesh; ``dp_dim`` without ep), each
    experts container over ``dp_dim`` -- and the bytes of the parameters FSDP cannot shard."""
    units: dict[tuple[str, str], int] = {}
    replicated = 0
    for s in shards:
        if s.fsdp_dim is None:
            replicated += s.fsdp_local_numel(dp) * s.dtype_bytes
            continue
        key = (dp_dim, s.experts) if s.experts else (state_dim or dp_dim, s.unit)
        units[key] = units.get(key, 0) + s.fsdp_padded_numel(s.fsdp_degree(dp, ep)) * s.dtype_bytes
    return units, replicated


def fsdp_collectives(shards: list[ParamShard], dp: int, dp_dim: str, ep: int = 1, state_dim: str | None = None
                     ) -> list[dict]:
    """The collectives FSDP2 issues in one forward+backward: per block unit (and per experts
    container) an all-gather in forward, another in backward (resharded after forward) and a
    reduce-scatter in backward; the root unit all-gathers once (it stays unsharded for backward)
    and reduce-scatters at the end of backward; parameters FSDP cannot shard (``fsdp_dim`` None)
    are averaged over dp in one all-reduce. With an ep dimension (``ep`` > 1) the non-expert
    units run on ``state_dim`` (:func:`fsdp_units`)."""
    units, replicated = fsdp_units(shards, dp, dp_dim, ep, state_dim)
    rows = [("all_reduce", "backward", replicated, dp_dim)] if replicated else []
    for (dim, unit), nbytes in sorted(units.items()):
        if unit:
            rows += [("all_gather", "forward", nbytes, dim), ("all_gather", "backward", nbytes, dim),
                     ("reduce_scatter", "backward", nbytes, dim)]
        else:
            rows += [("all_gather", "forward", nbytes, dim), ("reduce_scatter", "backward", nbytes, dim)]
    return [Collective(k, p, b, dim=d).to_row() for k, p, b, d in rows]
