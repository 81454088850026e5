"""Expert parallelism: the experts of every MoE layer split over the mesh's ``ep`` dimension.

Plan section ``parallel.ep``: null (no ep dimension, or one of size 1), or

    {"dim": "ep",                       # the mesh's ep dimension
     "styles": {"model.layers.*.mlp.experts": {"style": "ExpertParallel", "args": {...}}},
     "imbalance": 1.0}                  # routing-imbalance factor the planner priced (>= 1)

Tokens: the ep dimension shards the batch, as data parallel does (ep borrows from dp, the
runtime's default mode: every rank of an ep group holds different tokens, the all-to-alls bring
each expert its tokens from the whole group). So every gradient of a parameter outside the
experts is averaged over ep -- under FSDP by FSDP itself, which shards those parameters over the
flattened dp x ep mesh (``parallelisms.data.state_mesh``); otherwise after backward in one
all-reduce of their flattened local gradients, as replicated data parallel does over dp -- and
expert gradients -- which already hold the ep group's tokens, each rank's loss being its shard's
mean -- are divided by ep. With ``styles``
empty the ep dimension is pure data parallel (experts replicated: the planner's alternative when
expert parallelism does not pay); then every gradient is averaged over ep. Data parallel (FSDP,
ZeRO-1 or replicated over ``dp``) runs as usual on top: each dp rank then holds an ep group's
worth of batch shards.

Applied to the whole model after tensor parallel (``parallelize_module`` of the styles on the ep
dimension, strict); registry order between tp and ac. With a pipeline (pp > 1) the same: the
styles go on the whole model before the cut, the pipeline runner shards every micro-batch's rows
over ep inside each stage, and ``ExpertGradSync`` runs on this rank's stages after the schedule.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from autoplan.parallelisms.data import allreduce_gradients, dp_share, expert_containers, unique_params
from hyper_parallel import parallelize_module, style_from_dict
from hyper_parallel.errors import PipelineError

_STYLE = {"type": "object", "required": ["style", "args"], "additionalProperties": False,
          "properties": {"style": {"const": "ExpertParallel"}, "args": {"type": "object"}}}


def ep_section(plan) -> dict | None:
    return plan.parallel.get("ep")


def ep_dim(plan) -> str | None:
    """The plan's ep dimension when expert parallelism (or ep as data parallel) is active."""
    section = ep_section(plan)
    return section["dim"] if section else None


def ep_degree(plan) -> int:
    """How many ways the ep dimension shards the batch (1 without an active ep section)."""
    dim = ep_dim(plan)
    if dim is None:
        return 1
    return int(dict(zip(plan.mesh["names"], plan.mesh["shape"]))[dim])


def expert_parameters(model: nn.Module, plan) -> list[nn.Parameter]:
    """Parameters inside the experts containers the plan's ep styles name."""
    out, seen = [], set()
    for module in expert_containers(model, plan):
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ExpertGradSync:
    """What follows backward on the ep dimension (see the module docstring): one all-reduce over
    ep of every non-expert gradient (averaged) that FSDP over dp x ep has not already averaged
    (under FSDP only those it leaves out: tied across pipeline stages, unshardable; under ZeRO-1
    over dp x ep none: its reduce-scatter averages them), expert gradients divided by ep.

    ``target``: the ApplyTarget the plan was applied to; its ``roots`` (the model, or this rank's
    pipeline stages -- they keep the model's module paths, so the plan's patterns match them
    too) are read when called, after the pipeline cut and FSDP have replaced the parameters. The
    ranks of an ep group share their pipeline coordinate, so they hold the same stages and
    reduce the same parameters in the same order."""

    def __init__(self, target: ApplyTarget, plan, ep_mesh):
        self.target, self.plan, self.group, self.ep = target, plan, ep_mesh.get_group(), ep_mesh.size()

    def __call__(self) -> None:
        roots = self.target.roots or [self.target.model]
        experts = {id(p) for root in roots for p in expert_parameters(root, self.plan)}
        # FSDP over dp x ep (parallelisms.data.state_mesh) has averaged these over ep already; ZeRO-1
        # over dp x ep (data.zero1_of: True) averages every one of them in its reduce-scatter next
        params = unique_params(*roots)
        if self.target.state.get("dense_over_ep") is not True:
            # under FSDP over dp x ep only what it left out, by name (parameters are read now, not at apply)
            left_out = self.target.state.get("dense_left_out")
            named = {id(p): n for root in roots for n, p in root.named_parameters()}
            allreduce_gradients([p for p in params if id(p) not in experts
                                 and (left_out is None or named.get(id(p)) in left_out)], self.group, self.ep)
        with torch.no_grad():
            for p in params:
                if id(p) in experts and p.grad is not None:
                    _local(p.grad).div_(self.ep)


class ExpertParallelism(Parallelism):
    name = "ep"
    roles = ("ep",)
    order = 20
    schema = {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["dim", "styles", "imbalance"], "additionalProperties": False,
        "properties": {"dim": {"$ref": "#/$defs/name"}, "styles": {"type": "object", "additionalProperties": _STYLE},
                       "imbalance": {"type": "number", "minimum": 1}}}]}

    def check(self, section, data, roles, degree) -> None:
        if not self.check_own_dim(section, roles, degree, "the dimension would carry nothing (give an ep section, "
                                  "styles may be empty)"):
            return
        ep_name = roles.get("ep")
        tp_name = data["parallel"]["tp"]["dim"] or roles.get("tp")
        for pattern, spec in section["styles"].items():
            if not pattern or any(not atom for atom in pattern.split(".")):
                raise section_error("ep", "styles", f"{pattern!r} is not a module pattern")
            args = spec["args"]
            unknown = sorted(set(args) - {"ep_dim", "tp_dim", "balanced", "split_tokens"})
            if unknown:
                raise section_error("ep", f"styles/{pattern}/args", f"unknown ExpertParallel argument(s) {unknown}")
            if args.get("ep_dim", "ep") != ep_name:
                raise section_error("ep", f"styles/{pattern}/args/ep_dim", f"{args.get('ep_dim', 'ep')!r} is not the "
                                    f"ep dimension {ep_name!r}")
            if args.get("tp_dim") is not None and args["tp_dim"] != tp_name:
                raise section_error("ep", f"styles/{pattern}/args/tp_dim", f"{args['tp_dim']!r} is not the mesh's "
                                    f"tp dimension {tp_name!r}")
            if args.get("split_tokens"):
                raise section_error("ep", f"styles/{pattern}/args/split_tokens", "true, but a plan's ep dimension "
                                    "shards the batch (ep borrows from dp); split_tokens is for ep groups holding "
                                    "the same tokens")
            if args.get("balanced"):
                raise section_error("ep", f"styles/{pattern}/args/balanced", "true: balanced routing ignores the "
                                    "router and is for dry runs only (verify turns it on itself)")

    def active(self, plan) -> bool:
        return bool(ep_section(plan))

    def batch_ways(self, plan) -> int:
        return ep_degree(plan)

    def share_batch(self, applied: dict, inputs, targets, who: str):
        """Rows by this rank's ep coordinate: the ep dimension shards the batch (ep borrows from dp)."""
        return dp_share(inputs, targets, applied.get("ep_mesh"), who)

    def after_backward(self, applied: dict, optimizer) -> bool:
        if applied.get("ep_sync") is not None:
            applied["ep_sync"]()
        return False

    def traffic_dims(self, plan) -> tuple[str, ...]:
        """The ep dimension, and the tp dimension where expert TP runs in a plan whose tensor
        parallelism styles nothing else (otherwise tp owns that dimension)."""
        if not self.active(plan):
            return ()
        dims = (ep_dim(plan),)
        tp_dims = {s["args"].get("tp_dim") for s in ep_section(plan)["styles"].values()} - {None}
        if tp_dims and not plan.styles:
            dims += tuple(sorted(tp_dims))
        return dims

    def apply_to_model(self, plan, target: ApplyTarget) -> None:
        """The ExpertParallel styles on the ep dimension (strict: a pattern matching nothing is
        a plan for another model)."""
        section = ep_section(plan)
        target.state["ep_mesh"] = None
        if not section:
            return
        names = tuple(target.mesh.mesh_dim_names or ())
        if section["dim"] not in names:
            return
        if target.pipelined and (plan.pipeline or {}).get("preprocess") and target.mesh[section["dim"]].size() > 1:
            # the MPipe tower lives outside the stages: ExpertGradSync would not average its gradients
            raise PipelineError(f"plan.apply: an ep dimension ({section['dim']}={target.mesh[section['dim']].size()})"
                                f" with an MPipe tower (pipeline.preprocess) is not supported: the tower's gradients "
                                f"are not averaged over {section['dim']}; plan without ep or without the tower")
        if section["styles"]:
            parallelize_module(target.model, target.mesh,
                               {k: style_from_dict(v) for k, v in section["styles"].items()},
                               mesh_dim=section["dim"], strict=True)
        ep_mesh = target.mesh[section["dim"]]
        if ep_mesh.size() > 1:
            target.state["ep_mesh"] = ep_mesh
            target.state["ep_sync"] = ExpertGradSync(target, plan, ep_mesh)

