"""The expert decision of a mesh plan, from choice to plan parts (``autoplan.mesh_plan`` calls it).

``ExpertPlanning`` holds the MoE groups of a model on a mesh with an ep dimension, chooses each
group's option (``expert_search``), and turns the choice into what a plan stores: the
``parallel.ep`` section, the exact per-rank parameter shapes (expert weights split over ep and
expert TP), the collectives -- the all-to-alls and expert-TP all-reduces of every MoE layer, and
the one all-reduce over ep of every non-expert gradient that follows backward (the ep dimension
shards the batch: ``autoplan.parallelisms.expert``) -- and the step-time terms added to the TP
search's step.
"""
from __future__ import annotations

import dataclasses

from autoplan.search.experts.search import (
    OUR_EXPERT_RUNTIME, ExpertChoice, ExpertRuntime, choose_experts, expert_decision_rows, moe_groups,
)
from autoplan.search.pricing.sharding import ParamShard
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.fqn_pattern import fqn_matches

IMBALANCE = 1.0   # default routing-imbalance factor: balanced routing


def _under(pattern: str, param_fqn: str) -> bool:
    """``param_fqn`` is a parameter held directly by a module matching ``pattern``."""
    return fqn_matches(pattern, param_fqn.rsplit(".", 1)[0])


def shard_experts(shards: list[ParamShard], styled: list, ep: int, tp: int) -> list[ParamShard]:
    """Rank 0's shapes under ExpertParallel: ``styled`` holds (MoEGroup, ExpertParallel) pairs;
    dim 0 (experts) over ep, the expert-TP dimension (gate_up's output, down's input) over tp
    where the style has a tp_dim. One place for the one-stage plan and every pipeline rank."""
    out = []
    for s in shards:
        hit = next(((g, st) for g, st in styled if _under(g.pattern, s.fqn)), None)
        if hit is None or not s.local_shape:
            out.append(s)
            continue
        g, style = hit
        shape = list(s.local_shape)
        shape[0] = -(-shape[0] // ep)
        if style.tp_dim is not None:
            name = s.fqn.rsplit(".", 1)[-1]
            out_dim, in_dim = (2, 1) if g.layout.transposed else (1, 2)
            d = {"gate_up_proj": out_dim, "down_proj": in_dim, "gate_up_proj_bias": 1}.get(name)
            if d is not None:
                shape[d] = -(-shape[d] // tp)
        out.append(dataclasses.replace(s, local_shape=tuple(shape), experts=s.fqn.rsplit(".", 1)[0]))
    return out


def expert_parallel_constraint(stated: bool | None, allow_replicated_units: bool) -> bool | None:
    """The expert plan's ``expert_parallel``: as stated, else priced (None) -- or held to
    ExpertParallel where replicated units are not allowed: replicated experts on a mesh with an ep
    dimension are the replicated units ``allow_replicated_units=False`` forbids. Where it is not
    False the TP search takes the MoE layers as sharded by ep (``TPSearch.experts_by_ep``)."""
    if stated is not None:
        return stated
    return None if allow_replicated_units else True


class ExpertPlanning:
    def __init__(self, model, graph, structure, ctx, spec, imbalance: float = IMBALANCE,
                 expert_parallel: bool | None = None, groups=None, runtime: ExpertRuntime = OUR_EXPERT_RUNTIME):
        self.ctx, self.imbalance, self.constraint = ctx, float(imbalance), expert_parallel
        self.runtime = runtime   # the runtime whose routing glue the experts are priced with
        self.ep_dim, self.tp_dim = spec.dim("ep"), spec.dim("tp")
        self.ep = spec.degree(self.ep_dim)
        self.tp = spec.degree(self.tp_dim) if self.tp_dim else 1
        # ``groups``: the model's MoE groups already found (the cluster search prices many meshes)
        self.groups = moe_groups(graph, model, structure.dtype_bytes) if groups is None else groups
        b0 = structure.blocks[0] if structure.blocks else None
        self.tokens = int(b0.hidden_bytes // structure.dtype_bytes // max(b0.dim, 1)) if b0 else 1
        self.dtype_bytes = structure.dtype_bytes
        self.choice = self._choose(None)
        self.replicated_state = sum(opts[0].state_bytes for opts in self.choice.options)

    def _choose(self, room: float | None) -> ExpertChoice:
        return choose_experts(self.groups, self.ctx, tokens=self.tokens, dtype_bytes=self.dtype_bytes,
                              ep_name=self.ep_dim, ep=self.ep, tp_name=self.tp_dim, tp=self.tp,
                              imbalance=self.imbalance, memory_room=room, expert_parallel=self.constraint,
                              runtime=self.runtime)

    def best_saving(self) -> float:
        """Bytes per rank the smallest-state options free against replicated experts."""
        least = sum(min((o.state_bytes for o in opts if o.excluded is None), default=opts[0].state_bytes)
                    for opts in self.choice.options)
        return max(self.replicated_state - least, 0.0)

    def decide(self, total_with_replicated: float, limit: float) -> None:
        """Keep the fastest choice if it fits ``limit`` with everything else (the TP search's
        total, which counts the experts replicated); else the fastest that fits."""
        other = total_with_replicated - self.replicated_state
        if other + sum(o.state_bytes for o in self.choice.chosen) > limit:
            self.choice = self._choose(max(limit - other, 0.0))

    def _ep_groups(self):
        return [(g, o) for g, o in zip(self.choice.groups, self.choice.chosen) if o.style is not None]

    def shard(self, shards: list[ParamShard]) -> list[ParamShard]:
        """Rank 0's shapes with the chosen ExpertParallel styles (:func:`shard_experts`)."""
        return shard_experts(shards, [(g, o.style) for g, o in self._ep_groups()], self.ep, self.tp)

    def finish(self, shards: list[ParamShard], use_fsdp: bool, dp: int, recompute_blocks: bool = False) -> dict:
        """Collectives, step-time terms, decision rows and notes of the choice (``shards``: the
        plan's exact shapes, from :meth:`shard`). ``recompute_blocks``: full activation
        checkpointing reruns every block's forward in backward, all-to-alls included."""
        ep_patterns = [g.pattern for g, _ in self._ep_groups()]
        d = dp if use_fsdp else 1
        # under FSDP only what it leaves out (unshardable) is all-reduced over ep: it shards the
        # rest over dp x ep, whose reduce-scatter averages it there (parallelisms.data.state_mesh)
        sync_bytes = sum(s.fsdp_local_numel(d) * s.dtype_bytes for s in shards
                         if not any(_under(p, s.fqn) for p in ep_patterns)
                         and not (use_fsdp and s.fsdp_dim is not None))
        sync = Collective("all_reduce", "backward", int(sync_bytes), dim=self.ep_dim) if sync_bytes else None
        colls = [c for _, o in self._ep_groups() for c in o.collectives]
        if recompute_blocks:
            colls += [dataclasses.replace(c, phase="backward") for c in colls if c.phase == "forward"]
        ep_comm = sum(self.ctx.collective_time(c) for c in colls)
        colls += [sync] if sync is not None else []
        compute = sum(o.compute_s for o in self.choice.chosen) - self.choice.base_compute_s
        comm = ep_comm + (self.ctx.collective_time(sync) if sync is not None else 0.0)
        notes = list(self.choice.notes)
        if not self.groups:
            notes.append(f"{self.ep_dim}={self.ep}: no MoE layer recognised; the {self.ep_dim} dimension is data "
                         f"parallel (batch sharded, gradients all-reduced over it)")
        if use_fsdp:
            notes.append(f"{self.ep_dim} shards the batch (ep borrows from dp): {self.tokens} tokens per rank; FSDP "
                         f"shards every parameter outside the experts over dp x {self.ep_dim} (its reduce-scatter "
                         f"averages their gradients there), the experts over dp")
        else:
            notes.append(f"{self.ep_dim} shards the batch (ep borrows from dp): {self.tokens} tokens per rank; every "
                         f"gradient outside the experts is all-reduced over {self.ep_dim} after backward")
        return {"collectives": colls, "step_s": compute + comm, "comm_s": comm, "compute_s": compute,
                "decisions": expert_decision_rows(self.choice), "notes": notes}

    def section(self) -> dict:
        """The plan's ``parallel.ep``."""
        return {"dim": self.ep_dim, "styles": self.choice.styles, "imbalance": self.imbalance}
