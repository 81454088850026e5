"""Expert parallel inside a pipeline: what one pipeline rank of an ep x pp plan issues and holds.

``plan_cluster`` writes, for every pipeline rank, its exact collectives and parameter bytes
(``pipeline.rank_collectives`` / ``rank_param_bytes``; verify's pipeline dry run checks them).
With an ep dimension a rank's stages run their MoE layers under ``ExpertParallel`` -- the
all-to-alls of every MoE layer it holds, once per micro-batch, on the ep dimension -- its expert
weights are split over ep (and expert TP), and after the schedule the runtime averages every
non-expert gradient over ep in one all-reduce (``autoplan.parallelisms.expert.ExpertGradSync``)
-- under FSDP only those FSDP leaves out: it shards the others over dp x ep.
The rows come from the style the plan names (``ExpertParallel.predicted_collectives``) and the
shapes from ``experts.planning.shard_experts``, the objects the one-stage plan uses.
"""
from __future__ import annotations

from autoplan.search.experts.planning import _under, shard_experts
from autoplan.search.pricing.sharding import ParamShard
from hyper_parallel import style_from_dict
from hyper_parallel.core.collective import Collective


def styled_groups(groups: list, ep_section: dict | None) -> list:
    """(MoEGroup, ExpertParallel) for every MoE group the plan's ``parallel.ep`` styles."""
    styles = (ep_section or {}).get("styles") or {}
    return [(g, style_from_dict(styles[g.pattern])) for g in groups if g.pattern in styles]


def group_units(group) -> list[str]:
    """The pipeline units (blocks) holding the group's MoE layers."""
    owner = group.pattern[: -len(group.rel) - 1]
    if owner.endswith(".*") or owner == "*":
        return [f"{group.block_prefix}.{i}" if group.block_prefix else str(i) for i in group.indices]
    return [owner]


def expert_shards(shards: list[ParamShard], groups: list, ep_section: dict | None, ep: int, tp: int
                  ) -> list[ParamShard]:
    """``shards`` (rank 0's TP-local shapes) with the plan's expert weights split as ExpertParallel
    splits them."""
    styled = styled_groups(groups, ep_section)
    return shard_experts(shards, styled, ep, tp) if styled else shards


def ep_layer_rows(groups: list, ep_section: dict | None, *, tokens: int, dtype_bytes: int, ep: int, tp: int
                  ) -> dict[str, list[Collective]]:
    """Unit FQN -> the collectives ExpertParallel issues for that unit's MoE layer per micro-batch
    of ``tokens`` tokens (balanced routing, the dry run's)."""
    out: dict[str, list[Collective]] = {}
    for g, style in styled_groups(groups, ep_section):
        rows = style.predicted_collectives(tokens=tokens, hidden=g.layout.hidden, ffn=g.layout.ffn, top_k=g.top_k,
                                           experts=g.experts, dtype_bytes=dtype_bytes, ep=ep,
                                           tp=tp if style.tp_dim else 1)
        for u in group_units(g):
            out.setdefault(u, []).extend(rows)
    return out


def ep_sync_row(shards: list[ParamShard], groups: list, ep_section: dict | None, units: list[str], fsdp_dp: int,
                ep_dim: str, fsdp: bool = False, tied: dict[str, set[int]] | None = None,
                stages: set[int] = frozenset(), tied_bytes: int = 0) -> Collective | None:
    """The one all-reduce over ep of the non-expert gradients of the parameters in ``units`` (this
    rank's, FSDP-local over ``fsdp_dp``), or None when they hold none. Under FSDP (``fsdp``) only
    those it cannot shard: it shards the rest over dp x ep and its reduce-scatter averages them.

    ``tied``: the parameters tied across pipeline stages (``stage_params.tied_holders``: canonical
    FQN -> the stages holding a copy). Every copy is left out of FSDP and each holder's stage
    averages it over ep, wherever it sits -- the head's stage holds the embedding's table under
    the head's name, which no unit prefix finds. This rank (``stages``) counts each one it holds,
    whole after TP, at ``tied_bytes`` per element (the dtype its gradient is reduced in: fp32 under
    16-bit FSDP's master weights; 0: the parameter's own)."""
    tied = tied or {}
    patterns = [g.pattern for g, _ in styled_groups(groups, ep_section)]
    nbytes = 0
    for s in shards:
        if s.fqn in tied:
            if tied[s.fqn] & set(stages):
                nbytes += s.fsdp_local_numel(1) * (tied_bytes or s.dtype_bytes)
            continue
        if any(s.fqn.startswith(u + ".") for u in units) and not any(_under(p, s.fqn) for p in patterns) \
                and not (fsdp and s.fsdp_dim is not None):
            nbytes += s.fsdp_local_numel(fsdp_dp) * s.dtype_bytes
    return Collective("all_reduce", "backward", int(nbytes), dim=ep_dim) if nbytes else None
