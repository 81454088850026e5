"""plan_mesh(model, spec) -> Plan: the plan on a mesh whose degrees are fixed.

Capture, cost, solve and explain for one mesh: the TP search picks every module's style, the
reference assignments (replicated, Megatron, sequence parallel) are priced beside it, and the
winner becomes a Plan with its predicted collectives, memory and alternatives. Both public
entries reach it: :func:`autoplan.api.autoplan` for a mesh, and
:func:`autoplan.cluster.plan_cluster` on the (dp, pp, tp) mesh its search chose -- which is why
it is a module of its own rather than part of either.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from typing import Any

import torch

from autoplan import arguments as A
from autoplan.capture import capture
from autoplan.capture.inputs import BatchSpec
from autoplan.capture.opaque import OPAQUE, opaque_graph
from autoplan.errors import (
    CaptureError,
    InfeasiblePlanError,
    InvalidArgumentError,
    MissingInputsError,
    ModelTooLargeError,
    PlanningError,
)
from autoplan.parallelisms.data import flat_name
from autoplan import assembler
from autoplan.plan.plan import Plan
from autoplan.request import PlanRequest
from autoplan.search.context.cost import OVERLAP_NOTE, CPShape, cp_structure, cp_topology, grad_dims, price_cp
from autoplan.search.pricing.costing import CostContext
from autoplan.search.experts.planning import ExpertPlanning, expert_parallel_constraint
from autoplan.search.experts.memory import planned_saved_delta
from autoplan.unsharded import refuse_unsharded, refuse_untraced
from hyper_parallel.parallel_dims import ParallelDims
from autoplan.search.tp.probe import Prober
from autoplan.search.pricing.sharding import fsdp_collectives, param_shards, rank_param_bytes
from autoplan.search.units.structure import model_structure
from autoplan.search.tp.group_patterns import seal_group_wildcards
from autoplan.search.tp.search import Evaluation, SolverInfo, TPSearch
from cost_models.hardware import load_hardware
from cost_models.topology import mesh_topology
from hyper_parallel.core.context_parallel import ContextParallel
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.core.collective import Collective, merged_rows
from hyper_parallel.errors import HyperParallelError

log = logging.getLogger(__name__)

# named reference assignments, priced beside the solver's answer
REFERENCE_PLANS = {
    "replicated": ("R", {}),
    "megatron": ("R", {"attention": "heads_sharded", "mlp": "hidden_sharded", "embedding": "vocab_sharded",
                       "head": "vocab_sharded_gather"}),
    "megatron_loss_parallel": ("R", {"attention": "heads_sharded", "mlp": "hidden_sharded",
                                     "embedding": "vocab_sharded", "head": "loss_parallel"}),
    "sequence_parallel": ("S", {"attention": "heads_sharded", "mlp": "hidden_sharded", "norms": "sequence",
                                "final_norm": "sequence", "embedding": "vocab_sharded", "head": "loss_parallel"}),
}

def _collective_rows(ev: Evaluation, spec: ParallelDims, tp_dim: str | None, extra: list[dict]) -> list[dict]:
    """Tensor-parallel collectives of the chosen options plus the exact FSDP rows (``extra``)."""
    tp = [c.on(tp_dim) for c in ev.collectives if c.dim == "tp" and tp_dim is not None and spec.degree(tp_dim) > 1]
    return merged_rows(tp + [Collective.from_row(r) for r in extra])


def _bytes(value: float) -> int:
    """A byte figure as the exact integer a plan file stores (costs are computed in floats)."""
    return int(round(value))


def _block_prefix(owner: str) -> str | None:
    """The module holding a block group's members ("layers" for "layers.*" or "layers.0,layers.1")."""
    if not owner:
        return None
    first = owner.split(",")[0]
    return first.rsplit(".", 1)[0] if "." in first else ""


def _decision_rows(ev: Evaluation, ctx: CostContext, search: TPSearch | None = None) -> list[dict]:
    """One row per unit: the chosen strategy and, under ``options``, every candidate with its
    cost, so ``explain`` can say why the others lost."""
    rows = []
    for o in sorted(ev.options, key=lambda o: o.slot):
        if o.slot in ("rest",) or (o.slot.endswith("/other")):
            continue
        mem = o.memory(ctx)
        row = {
            "unit": o.slot, "block_prefix": _block_prefix(o.owner),
            "count": o.count, "strategy": o.strategy.name, "stream": o.stream or "-",
            "reason": o.strategy.reason, "modules": sorted(o.styles()),
            "compute_s": o.compute_s(ctx), "comm_s": o.comm_s(ctx), "memory_bytes": _bytes(sum(mem.values())),
            "module": search.unit_module(o.slot) if search is not None else o.slot,
        }
        if o.strategy.extra.get("uneven"):
            row["uneven"] = o.strategy.extra["uneven"]
        if search is not None and o.slot in search.slots:
            row["options"] = [
                {"strategy": c.strategy.name, "stream": c.stream or "-", "compute_s": c.compute_s(ctx),
                 "comm_s": c.comm_s(ctx), "memory_bytes": _bytes(sum(c.memory(ctx).values())), "reason": c.strategy.reason,
                 "excluded": c.strategy.extra.get("tp_excluded")}
                for c in search.slots[o.slot]]
        rows.append(row)
    return rows


def _pad_to_signature(styles: dict[str, dict], model: torch.nn.Module) -> dict[str, dict]:
    """Give PrepareModuleInput layouts one entry per required positional input of the module's
    forward (None for the extra ones), so the plan also works with torch's stricter styles."""
    out = {}
    for pattern, spec in styles.items():
        spec = {"style": spec["style"], "args": dict(spec["args"])}
        args = spec["args"]
        if spec["style"] in ("PrepareModuleInput", "PrepareModuleInputOutput") and args.get("input_layouts"):
            matches = match_modules(model, pattern)
            if matches:
                params = inspect.signature(matches[0][1].forward).parameters.values()
                need = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                           and p.default is p.empty)
                extra = need - len(args["input_layouts"])
                if extra > 0:
                    args["input_layouts"] = list(args["input_layouts"]) + [None] * extra
                    args["desired_input_layouts"] = list(args["desired_input_layouts"]) + [None] * extra
        out[pattern] = spec
    return out


def _summary(name: str, ev: Evaluation) -> dict:
    return {"name": name, "step_s": ev.step_s, "compute_s": ev.compute_s, "comm_s": ev.comm_s,
            "memory_bytes": _bytes(ev.memory_total),
            "strategies": {o.slot: o.strategy.name for o in ev.options if o.slot != "rest" and not o.slot.endswith("/other")}}

def _capture_graph(model: torch.nn.Module, inputs: Any, batch: Any, dp: int, dtype: torch.dtype, cp: int = 1):
    """The ModelGraph of one rank's share: ``global_batch / dp`` sequences of ``seq_len / cp``
    tokens (context parallel: its head and tail chunks); argument errors are said in the user's terms."""
    if inputs is None and batch is None:
        raise MissingInputsError("autoplan: give batch=(global_batch, seq_len) or example inputs=")
    cap_batch = None
    if batch is not None:
        gb, seq = A.check_batch(batch, "autoplan")
        if gb % dp:
            raise InfeasiblePlanError(f"autoplan: global batch {gb} is not divisible by dp={dp}; "
                                      f"give a multiple of {dp}")
        if inputs is None:
            A.check_batch_fits_model(model, seq, "autoplan")
        cap_batch = (gb // dp, seq // cp)
    try:
        return capture(model, inputs, batch=cap_batch, dtype=dtype)
    except (MissingInputsError, ModelTooLargeError):
        raise
    except CaptureError as exc:
        if cap_batch is None:  # example inputs that do not run: the user's to fix
            raise
        reason = f"capture could not trace {type(model).__name__} ({exc}); planned data-parallel only"
        log.warning("%s", reason)
        return opaque_graph(model, cap_batch[0] * cap_batch[1], str(dtype), reason)


def _check_cp_model(model: torch.nn.Module, batch: Any, inputs: Any, cp: int) -> None:
    """A cp plan needs a causal model the ContextParallel style can hook, and a batch shape whose
    sequence splits into 2*cp equal chunks."""
    if batch is None or inputs is not None:
        raise InvalidArgumentError(f"autoplan: a mesh with cp={cp} needs batch=(global_batch, seq_len) (the whole "
                                   "sequence), not inputs=")
    seq = A.check_batch(batch, "autoplan")[1]
    if seq % (2 * cp):
        raise InvalidArgumentError(f"autoplan: batch seq_len={seq} is not divisible by 2*cp = {2 * cp} (context "
                                   f"parallel cuts each sequence into 2*cp equal chunks); give a multiple of {2 * cp}")
    try:
        ContextParallel().check_model(model, "autoplan (cp)")
    except HyperParallelError as e:
        raise InvalidArgumentError(f"autoplan: the mesh has cp={cp}, but {e}") from None


def _add_cp(ev: Evaluation, search: TPSearch, chosen: dict, cp_shape: CPShape | None, limit: float):
    """Price context parallelism for an evaluated assignment and add it in place: the exposed
    exchange to the step, the extra saved K/V to activations. Returns the CPChoice (None: no cp)."""
    if cp_shape is None:
        return None
    choice = price_cp(search.structure, search.graph, search.ctx, chosen, cp_shape, memory_left=limit - ev.memory_total)
    ev.step_s += choice.exposed_s
    ev.comm_s += choice.exposed_s
    ev.memory["activations"] = ev.memory.get("activations", 0.0) + choice.extra_memory
    return choice


def plan_mesh(model: torch.nn.Module, spec: ParallelDims, request: PlanRequest, *, graph=None,
              styles: dict | None = None) -> Plan:
    """:func:`autoplan` on a mesh, its request already checked: the plan, built."""
    draft = mesh_plan_draft(model, spec, request, graph=graph, styles=styles)
    return assembler.finish(assembler.with_precision(draft, model, request.precision))


def mesh_plan_draft(model: torch.nn.Module, spec: ParallelDims, request: PlanRequest, *, graph=None,
                    styles: dict | None = None, prober: Prober | None = None,
                    microbatch_size: int | None = None) -> Plan:
    """The mesh plan as a draft the cluster search completes (``plan_cluster`` calls it with
    its own (dp, pp, tp) mesh, whose pp the pipeline search has already handled, and with the
    search's prober at that degree, whose verdicts already cover the styles it priced). With an
    ep dimension the experts are planned beside the TP search (``experts.planning``);
    ``request.expert_parallel`` True/False restricts that choice (None: priced). ``microbatch_size``:
    the sequences one forward runs on a rank when ``graph`` is a micro-batch's (plan_cluster's
    gradient accumulation); default the whole local batch, ``global_batch / dp``."""
    inputs, batch, dtype = request.inputs, request.batch, request.dtype
    fsdp = True if request.fsdp is None else request.fsdp
    allow_replicated_units, sequence_parallel = request.allow_replicated_units, request.sequence_parallel
    t_start = time.perf_counter()
    hw = load_hardware(spec.hardware)
    tp_dim, dp_dim, cp_dim = spec.dim("tp"), spec.dim("dp"), spec.dim("cp")
    tp, dp = spec.degree(tp_dim) if tp_dim else 1, spec.degree(dp_dim) if dp_dim else 1
    cp = spec.degree(cp_dim) if cp_dim else 1
    ep_dim = spec.dim("ep")
    ep = spec.degree(ep_dim) if ep_dim else 1   # shards the batch too (ep borrows from dp)
    # gradients (and FSDP) over dp, or over the flattened dp x cp under context parallelism
    grad_dim, grad_ranks = (flat_name(grad_dims(spec)), dp * cp) if cp > 1 else (dp_dim, dp)
    if cp > 1:
        _check_cp_model(model, batch, inputs, cp)
        if dp_dim is not None and spec.names.index(cp_dim) != spec.names.index(dp_dim) + 1:
            raise InvalidArgumentError(f"autoplan: mesh names {spec.names}: the cp dimension must follow the dp "
                                       "dimension (gradients average over the flattened dp x cp mesh)")
    if dtype is None:
        dtype = torch.float32 if hw.device_type == "cpu" else torch.bfloat16
    if graph is None:
        graph = _capture_graph(model, inputs, batch, dp * ep, dtype, cp)
    t_captured = time.perf_counter()
    if graph.method == OPAQUE and tp > 1 and sequence_parallel is True:
        raise InfeasiblePlanError(f"autoplan: sequence_parallel=True at tp={tp}, but {graph.warnings[0]}: nothing "
                                  f"in it can be tensor-parallel or sequence-sharded")
    if graph.method == OPAQUE:   # a model that needs sharding is refused, not planned data-parallel
        refuse_untraced(graph, type(model).__name__, tp, allow_replicated_units)
    structure = cp_structure(model_structure(graph, compile=request.compile), cp)
    element_bytes = structure.dtype_bytes   # of a parameter
    ctx = CostContext(hardware=hw, topology=mesh_topology(spec), dtype=str(dtype), tp_dim=tp_dim or "tp",
                      dp_dim=grad_dim, dp=grad_ranks, fsdp=fsdp and grad_ranks > 1, param_bytes_per_element=element_bytes,
                      optimizer_bytes_per_element=8 + (4 if element_bytes < 4 else 0),
                      async_tp=request.overlap == "async_tp", float8=A.FLOAT8_PRICING[request.precision],
                      compiled=request.compile != "none")
    cp_shape = None
    if cp > 1:
        ctx = dataclasses.replace(ctx, topology=cp_topology(spec))
        cp_shape = CPShape(cp=cp, cp_dim=cp_dim, loss_dim=grad_dim, local_batch=microbatch_size or int(batch[0]) // dp,
                           seq_len=int(batch[1]), dtype_bytes=torch.empty((), dtype=dtype).element_size(), tp=tp)
    limit = request.memory_limit if request.memory_limit is not None else float(hw.usable_memory())  # the profile's stated headroom
    expert_parallel = expert_parallel_constraint(request.expert_parallel, allow_replicated_units)
    experts_by_ep = ep > 1 and expert_parallel is not False   # the MoE layers: sharded by ep, no TP unit
    experts = ExpertPlanning(model, graph, structure, ctx, spec, expert_parallel=expert_parallel) if ep > 1 else None
    user_limit = limit
    if experts is not None:  # the TP search counts experts replicated: give it the room EP frees
        limit += experts.best_saving()
    search = best = cp_choice = None
    info = None
    # the probe runs the model on token ids: the batch's sequence, not the first block's (a VL
    # model's first block is its vision tower's, over image patches)
    seq = BatchSpec.coerce(batch).seq_len if batch is not None else (
        structure.blocks[0].seq_len if structure.blocks else 1)
    if prober is None and tp > 1 and graph.blocks:
        prober = Prober(model, graph.blocks, tp, (1, seq), dtype)
    ac_modes = [False, True] if request.activation_checkpointing is None else [bool(request.activation_checkpointing)]
    for ac in ac_modes:  # full activation checkpointing of blocks: an exact two-way enumeration
        ctx_ac = dataclasses.replace(ctx, recompute="full" if ac else "none")
        s_ac = TPSearch(structure, graph, ctx_ac, tp, allow_replicated=allow_replicated_units,
                        sequence_parallel=sequence_parallel, prober=prober, experts_tp=ep == 1,
                        experts_by_ep=experts_by_ep)
        if styles is not None:
            t_fix = time.perf_counter()
            chosen_ac, layout_ac, unmatched = s_ac.assignment_from_styles(styles)
            if not unmatched and not s_ac.checked(chosen_ac, layout_ac):  # a run rejected one: match again
                chosen_ac, layout_ac, unmatched = s_ac.assignment_from_styles(styles)
            info_ac = SolverInfo("none", "imported", time.perf_counter() - t_fix, 0, 0)
            if unmatched:
                raise PlanningError(f"autoplan(styles=...): no strategy accounts for {unmatched}")
            ev_ac = s_ac.evaluate(chosen_ac, layout_ac)
            if ev_ac.memory_total > limit and ac != ac_modes[-1]:
                continue
        else:
            chosen_ac, layout_ac, info_ac = s_ac.solve(limit)
        info = info_ac if info is None else info
        if not chosen_ac:
            continue
        ev = s_ac.evaluate(chosen_ac, layout_ac)
        cp_ac = _add_cp(ev, s_ac, chosen_ac, cp_shape, limit)
        if best is None or ev.step_s < best.step_s:
            search, best, chosen, layout, info, ctx, cp_choice = s_ac, ev, chosen_ac, layout_ac, info_ac, ctx_ac, cp_ac
    if best is None:
        ctx_min = dataclasses.replace(ctx, recompute="full" if ac_modes[-1] else "none")
        s_min = TPSearch(structure, graph, ctx_min, tp, allow_replicated=allow_replicated_units,
                         sequence_parallel=sequence_parallel, prober=prober, experts_tp=ep == 1,
                         experts_by_ep=experts_by_ep)
        least, least_layout, _ = s_min.solve(objective="memory")
        need = s_min.evaluate(least, least_layout).memory_total if least else float("nan")
        if experts is not None:  # the TP search counts the experts replicated
            need -= experts.best_saving()
        raise InfeasiblePlanError(
            f"autoplan: no plan fits memory_limit={limit / 2**30:.2f} GiB per rank on mesh "
            f"{dict(zip(spec.names, spec.shape))}; the minimum is {need / 2**30:.2f} GiB per rank "
            f"(solver status {info.status})")

    limit = user_limit
    if experts is not None:
        experts.decide(best.memory_total, limit)
        # what ExpertParallel's forward saves beyond the captured expert forward (moe_memory)
        best.memory["activations"] = best.memory.get("activations", 0.0) + planned_saved_delta(
            experts, model, dtype, ctx.checkpoint_blocks)
    alternatives = []
    for name, (lay, prefer) in REFERENCE_PLANS.items():
        if lay not in search.layouts:
            continue
        try:
            ref = search.assignment(lay, prefer)
            ev = search.evaluate(ref, lay)
        except InfeasiblePlanError:
            continue
        _add_cp(ev, search, ref, cp_shape, limit)
        alternatives.append(_summary(name, ev))
    alternatives.sort(key=lambda a: (a["step_s"], a["name"]))

    notes = list(search.soundness.notes(structure))
    if graph.method == OPAQUE:
        notes = graph.warnings[:1] + notes
    if cp_choice is not None:
        priced = ", ".join(f"{v}: exchange {d['exchange_s']:.3g}s, exposed {d['exposed_s']:.3g}s, extra memory "
                           f"{d['extra_memory'] / 2**30:.3g} GiB" for v, d in sorted(cp_choice.candidates.items()))
        notes.append(f"{OVERLAP_NOTE}; cp={cp} on {cp_dim}: chose {cp_choice.variant} ({priced})")
    for o in chosen.values():
        if o.strategy.extra.get("tp_excluded"):
            notes.append(f"{search.unit_module(o.slot)}: kept replicated: {o.strategy.extra['tp_excluded']}")
        if o.strategy.extra.get("uneven"):
            notes.append(f"{search.unit_module(o.slot)}: uneven shards, {o.strategy.extra['uneven']}")
    sharded = [o for o in chosen.values() if o.strategy.param_shard > 1 or o.strategy.compute_shard > 1]
    why_replicated = ""
    if tp > 1 and not sharded and graph.method != OPAQUE:
        others = [a for a in alternatives if a["name"] != "replicated"]
        if others:
            b2 = others[0]
            why_replicated = (f"tensor parallelism does not pay on this model at tp={tp}: replicated step "
                              f"{best.step_s:.3g}s vs {b2['name']} {b2['step_s']:.3g}s, whose communication "
                              f"({b2['comm_s']:.3g}s) exceeds the compute it saves")
            notes.append(why_replicated)
    if graph.method != OPAQUE and styles is None:   # a model that needs sharding is never left whole
        refuse_unsharded(graph, structure, chosen, type(model).__name__, tp, allow_replicated_units, why_replicated,
                         experts_by_ep)
    styles = {}
    for o in sorted(best.options, key=lambda o: o.slot):
        for pattern, style in o.styles().items():
            styles[pattern] = style.to_dict()
    styles = seal_group_wildcards(styles, structure.blocks, graph.modules)
    styles = dict(sorted(_pad_to_signature(styles, model).items()))
    shards = param_shards(graph, styles, tp, [b.prefix for b in structure.blocks])
    if experts is not None:
        shards = experts.shard(shards)
    # under cp FSDP shards over dp x cp (or cp alone); with an ep dimension FSDP shards the
    # non-expert parameters over dp (x cp) x ep too, at dp 1 over ep alone
    # (parallelisms.data.state_mesh); the experts over dp (x cp)
    use_fsdp = bool(fsdp and (grad_ranks > 1 or ep > 1 and dp_dim is not None))
    fsdp_ep = ep if use_fsdp and ep > 1 else 1
    state_dim = grad_dim if fsdp_ep == 1 else flat_name(tuple(sorted(
        [d for d in (dp_dim, cp_dim if cp > 1 else None) if d] + [ep_dim], key=list(spec.names).index)))
    fsdp_rows = [r for r in fsdp_collectives(shards, grad_ranks, grad_dim, fsdp_ep, state_dim)
                 if grad_ranks > 1 or r["mesh_dim"] != grad_dim] if use_fsdp else []
    if grad_ranks > 1 and not use_fsdp:  # replicated DP (and cp): one all-reduce of the flattened local gradients
        fsdp_rows = [Collective("all_reduce", "backward", int(rank_param_bytes(shards, grad_ranks, False)),
                                dim=grad_dim).to_row()]
    if cp_choice is not None:
        fsdp_rows += [c.to_row() for c in cp_choice.collectives]
    memory = dict(best.memory)
    param_bytes = int(rank_param_bytes(shards, grad_ranks, use_fsdp, fsdp_ep))
    memory = {k: _bytes(v) for k, v in memory.items()}  # byte figures are exact integers in a plan
    memory.update(params=param_bytes, grads=param_bytes,
                  optimizer=param_bytes // element_bytes * int(ctx.optimizer_bytes_per_element))
    loss_par = any(o.strategy.extra.get("loss_parallel") for o in chosen.values())
    step_s, comm_s, compute_s = best.step_s, best.comm_s, best.compute_s
    coll_rows = _collective_rows(best, spec, tp_dim, fsdp_rows)
    decisions = _decision_rows(best, ctx, search)
    if experts is not None:
        extra = experts.finish(shards, use_fsdp, dp, recompute_blocks=bool(ctx.checkpoint_blocks))
        step_s, comm_s, compute_s = step_s + extra["step_s"], comm_s + extra["comm_s"], compute_s + extra["compute_s"]
        coll_rows = merged_rows([Collective.from_row(r) for r in coll_rows] + extra["collectives"])
        decisions += extra["decisions"]
        notes = [n for n in notes if "mixture-of-experts layer" not in n] + extra["notes"]
    t_end = time.perf_counter()
    sections = {}
    if cp_choice is not None:
        sections["cp"] = cp_choice.section()
    if experts is not None:
        sections["ep"] = experts.section()
    return assembler.build(dict(
        mesh=spec.to_dict(), tp_dim=tp_dim, dp_dim=dp_dim, styles=styles, stream_layout=layout,
        loss_parallel=loss_par, fsdp={"enabled": use_fsdp, "dim": dp_dim if use_fsdp else None},
        activation_checkpointing=bool(ctx.checkpoint_blocks),
        decisions=decisions,
        predictions={"step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
                     "memory_bytes": dict(memory, total=sum(memory.values())),
                     "collectives": coll_rows, "compile": request.compile, "overlap": request.overlap},
        alternatives=alternatives,
        solver={"name": info.solver, "status": info.status, "variables": info.variables,
                "constraints": info.constraints},
        model={"type": graph.model_type, "num_parameters": int(graph.num_parameters),
               "blocks": [{"prefix": b.prefix, "count": b.count} for b in structure.blocks]},
        batch={"global_batch": int(batch[0]) if batch else None, "seq_len": int(batch[1]) if batch else None,
               "dtype": str(dtype)},
        notes=notes,
        timing={"capture_s": t_captured - t_start, "solve_s": info.time_s, "total_s": t_end - t_start,
                "probe_s": search.soundness.seconds, "probe_runs": search.soundness.runs},
    ), sections)
