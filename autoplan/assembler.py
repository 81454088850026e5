"""The one place a Plan is built: the searches' results in, a sealed Plan out.

Why one place: a plan used to be assembled by mutation wherever a search finished -- the mesh
planner built one, the cluster search overwrote its predictions, pipeline, alternatives and solver
report, the data-parallel modes, the vision tower and HSDP each wrote into it -- so what a plan
held depended on the order of a dozen writes spread over seven files. Here the planner's answers
are written into a draft, and the draft is sealed: after that a plan's fields refuse assignment
(``PlanSealedError``) and a changed plan is a new one (``plan.replace``). ``tests/planner/
test_assembler.py`` fails on a write to a plan's fields anywhere else.

What is written, in the order the runners apply it:

- :func:`build` -- a mesh plan from the tensor-parallel search's decisions, predictions and the
  context / expert sections (``autoplan.mesh_plan``);
- :func:`with_recompute`, :func:`with_dp_mode`, :func:`with_accumulation`,
  :func:`with_mixed_precision` -- the cluster search's recomputation, data-parallel mode, gradient
  accumulation and FSDP2 mixed precision, each with the exact collectives and per-rank state bytes
  the runtime then has (``autoplan.search.data.modes`` computes them; see its docstring);
- :func:`with_cluster_parts` -- the cluster search's pipeline, predictions, alternatives, solver
  report and notes (``autoplan.cluster``);
- :func:`to_hsdp`, :func:`fastest_of`, :func:`with_notes` -- the HSDP plan of a replica plan, and the
  fastest of several plans with the others as its alternatives (``plan_hsdp``, ``plan_context``).

A function given a sealed plan works on a copy and returns it; given a draft it edits the draft.
"""
from __future__ import annotations

from typing import Any

from autoplan.errors import PlanningError
from autoplan.parallelisms.data import flat_name, grad_dims, plan_dp_mode, state_dims
from autoplan.plan.plan import Plan, draft, is_sealed, sealed
from autoplan.precision.request import decide_precision
from autoplan.search.data.hsdp_splits import DP_REPLICATE, hsdp_replicate_rows, hsdp_replicate_time
from autoplan.search.data.modes import MIXED_PRECISION, REDUCE_BYTES, attention_patterns, zero1_rows
from autoplan.search.units.structure import ModelStructure
from hyper_parallel.core.collective import Collective, merged_rows
from hyper_parallel.parallel_dims import ParallelDims

__all__ = ["build", "finish", "with_recompute", "with_dp_mode", "with_accumulation", "with_mixed_precision",
           "with_cluster_parts", "with_precision", "with_fsdp_options", "with_notes", "to_hsdp", "fastest_of"]


def _open(plan: Plan) -> tuple[Plan, bool]:
    """(a plan this module may write: the draft itself, or a copy of a sealed plan; whether to
    seal the result again)."""
    return (draft(plan), True) if is_sealed(plan) else (plan, False)


def _close(plan: Plan, seal: bool) -> Plan:
    return sealed(plan) if seal else plan


def build(fields: dict[str, Any], sections: dict[str, dict] | None = None) -> Plan:
    """A draft plan from the decisions by name (``Plan.from_fields``) and whole parallelism
    sections (``cp``, ``ep``: the context and expert searches' choices)."""
    plan = Plan.from_fields(**fields)
    for name, section in (sections or {}).items():
        plan.parallel[name] = section
    return plan


def finish(plan: Plan) -> Plan:
    """The draft, sealed: from now on a value."""
    return sealed(plan)


# ---- the cluster search's modes -----------------------------------------------------------------

def with_recompute(plan: Plan, structure: ModelStructure, mode: str) -> Plan:
    """Set the plan's recomputation: ``none`` | ``selective`` | ``full``."""
    if mode not in ("none", "selective", "full"):
        raise PlanningError(f"recompute={mode!r} is not one of none, selective, full")
    plan, seal = _open(plan)
    plan.activation_checkpointing = mode == "full"
    plan.recompute = {"mode": "selective", "modules": attention_patterns(structure)} if mode == "selective" else {}
    return _close(plan, seal)


def with_dp_mode(plan: Plan, graph, structure: ModelStructure, mode: str, optimizer_bytes_per_element: int) -> Plan:
    """A one-stage plan made with replicated dp (``fsdp=False``) in ``mode``.

    ``fsdp`` and ``replicate`` plans come out of the mesh planner as they are; ``zero1`` replaces
    the replicated all-reduce by ZeRO-1's reduce-scatter + all-gather and shards the optimizer
    state (fp32 master weights included) over dp."""
    if mode not in ("fsdp", "zero1", "replicate"):
        raise PlanningError(f"dp_mode={mode!r} is not one of fsdp, zero1, replicate")
    plan, seal = _open(plan)
    dp_dim = plan.dp_dim
    dp = dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(dp_dim, 1) if dp_dim else 1
    if mode != "zero1" or dp <= 1:   # (an FSDP plan at dp 1 shards over ep: parallelisms.data.state_mesh)
        plan.fsdp = dict(plan.fsdp, mode=mode if dp > 1 or plan.fsdp.get("enabled") else
                         plan.fsdp.get("mode", "replicate"))
        return _close(plan, seal)
    if plan.fsdp.get("enabled"):
        raise PlanningError("with_dp_mode: make the plan with fsdp=False before turning it into zero1")
    tp = dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(plan.tp_dim, 1) if plan.tp_dim else 1
    rows, n = zero1_rows(graph, plan.styles, tp, [b.prefix for b in structure.blocks], dp, dp_dim)
    kept = [r for r in plan.predictions["collectives"] if r["mesh_dim"] != dp_dim]
    plan.predictions["collectives"] = sorted(kept + rows, key=lambda r: (r["kind"], r["mesh_dim"], r["phase"],
                                                                         r["bytes"]))
    mem = dict(plan.predictions["memory_bytes"])
    mem.pop("total", None)
    mem["optimizer"] = -(-n // dp) * optimizer_bytes_per_element
    plan.predictions["memory_bytes"] = _exact(mem)
    plan.fsdp = {"enabled": False, "dim": dp_dim, "mode": "zero1"}
    return _close(plan, seal)


def with_zero1_rows(plan: Plan, rows: list[dict], optimizer_bytes: int) -> Plan:
    """A one-stage plan with an ep dimension made with replicated dp, turned into ZeRO-1 over
    dp x ep: ``rows`` (the runtime's reduce-scatters and all-gathers, ``cluster.zero1_ep_rows``)
    replace its dp rows and the all-reduce over ep of the non-expert gradients (ZeRO-1's
    reduce-scatter over dp x ep averages them there); ``optimizer_bytes``: this rank's sharded state."""
    plan, seal = _open(plan)
    if plan.fsdp.get("enabled"):
        raise PlanningError("with_zero1_rows: make the plan with fsdp=False before turning it into zero1")
    ep_dim = (plan.parallel.get("ep") or {}).get("dim")
    kept = [r for r in plan.predictions["collectives"] if r["mesh_dim"] != plan.dp_dim
            and not (r["mesh_dim"] == ep_dim and r["kind"] == "all_reduce")]
    plan.predictions["collectives"] = sorted(kept + list(rows), key=lambda r: (r["kind"], r["mesh_dim"], r["phase"],
                                                                               r["bytes"]))
    mem = dict(plan.predictions["memory_bytes"])
    mem.pop("total", None)
    mem["optimizer"] = optimizer_bytes
    plan.predictions["memory_bytes"] = _exact(mem)
    plan.fsdp = {"enabled": False, "dim": plan.dp_dim, "mode": "zero1"}
    return _close(plan, seal)


def with_fsdp_mode(plan: Plan, mode: str) -> Plan:
    """Name the data-parallel mode of an FSDP plan (cp plans run FSDP over dp x cp)."""
    plan, seal = _open(plan)
    plan.fsdp = dict(plan.fsdp, mode=mode)
    return _close(plan, seal)


def with_accumulation(plan: Plan, m: int) -> Plan:
    """The collectives of a one-stage plan whose step is ``m`` micro-batches of gradient
    accumulation, from the rows of one micro-batch's step (``autoplan.search.data.modes``)."""
    if m <= 1:
        return plan
    plan, seal = _open(plan)
    mode = plan.fsdp.get("mode") or ("fsdp" if plan.fsdp.get("enabled") else "replicate")
    ep_dim = (plan.parallel.get("ep") or {}).get("dim")
    flat = flat_name(grad_dims(plan))   # the all-reduce of FSDP's left-out parameters runs on it

    def once_per_step(r: dict) -> bool:
        if mode in ("replicate", "zero1") and r["mesh_dim"] == plan.dp_dim:
            return True
        if mode == "zero1" and r["mesh_dim"] == flat_name(state_dims(plan)):   # ZeRO-1 over dp x ep
            return True
        return r["kind"] == "all_reduce" and r["phase"] == "backward" and (
            r["mesh_dim"] == ep_dim or (mode == "fsdp" and r["mesh_dim"] == flat))

    plan.predictions["collectives"] = [r if once_per_step(r) else dict(r, count=r["count"] * m)
                                       for r in plan.predictions["collectives"]]
    return _close(plan, seal)


def _exact(mem: dict) -> dict:
    """Memory by kind as the exact integers a plan file stores, with their total."""
    out = {k: int(round(v)) for k, v in mem.items()}
    return dict(out, total=sum(out.values()))


def with_mixed_precision(plan: Plan) -> Plan:
    """FSDP2 mixed precision on a 16-bit FSDP plan: fp32 sharded master parameters, bf16
    all-gathers, fp32 reduce-scatters (the rows and the state bytes as the runtime has them)."""
    dtype = str(plan.batch.get("dtype", "")).replace("torch.", "")
    if not plan.fsdp.get("enabled") or dtype not in ("bfloat16", "float16") or plan.fsdp.get("mixed_precision"):
        return plan
    plan, seal = _open(plan)
    element_bytes = 2
    scale = REDUCE_BYTES / element_bytes
    # FSDP's reduce-scatters run on the gradient mesh: dp, or the flattened dp x cp under cp
    dp_dim = flat_name(grad_dims(plan)) if plan.parallel.get("cp") else plan.fsdp.get("dim") or plan.dp_dim
    # expert parallel: the all-reduces over ep after backward carry the (fp32) gradients too
    ep_dim = (plan.parallel.get("ep") or {}).get("dim")
    # ... and FSDP's reduce-scatters of the non-expert units over the flattened dp x ep mesh
    state_dim = flat_name(state_dims(plan))

    def fp32_reductions(rows: list[dict]) -> list[dict]:
        return [dict(r, bytes=int(r["bytes"] * scale)) if (r["mesh_dim"] in (dp_dim, state_dim)
                                                          and r["kind"] == "reduce_scatter")
                or (r["mesh_dim"] == ep_dim and r["kind"] == "all_reduce" and r["phase"] == "backward") else r
                for r in rows]

    plan.predictions["collectives"] = fp32_reductions(plan.predictions["collectives"])
    if plan.pipeline and plan.pipeline.get("rank_collectives"):   # every pipeline rank's rows (verify reads each)
        plan.pipeline["rank_collectives"] = [fp32_reductions(rows) for rows in plan.pipeline["rank_collectives"]]
    mem = dict(plan.predictions["memory_bytes"])
    mem.pop("total", None)
    elements = mem.get("params", 0.0) / element_bytes
    mem.update(params=elements * 4, grads=elements * 4, optimizer=elements * 8)
    plan.predictions["memory_bytes"] = _exact(mem)
    if plan.pipeline and plan.pipeline.get("rank_param_bytes"):
        plan.pipeline["rank_param_bytes"] = [int(b) * 4 // element_bytes for b in plan.pipeline["rank_param_bytes"]]
    plan.fsdp = dict(plan.fsdp, mixed_precision=dict(MIXED_PRECISION, param_dtype=dtype))
    return _close(plan, seal)


# ---- the cluster search's answer ----------------------------------------------------------------

def with_cluster_parts(plan: Plan, *, pipeline: dict, predictions: dict, alternatives: list[dict], solver: dict,
                       notes: list[str], timing: dict) -> Plan:
    """The cluster search's pipeline (stages, schedule, every rank's rows, a vision tower's
    placement), predictions, ranked alternatives, solver report and notes, replacing the mesh
    planner's, then FSDP2 mixed precision on what that makes 16-bit FSDP."""
    plan, seal = _open(plan)
    plan.pipeline = pipeline
    plan.predictions = predictions
    plan.alternatives = alternatives
    plan.solver = solver
    plan.notes = list(plan.notes) + list(notes)
    plan = with_mixed_precision(plan)   # 16-bit FSDP plans: FSDP2 policy, fp32 master weights and reduction
    plan.timing = timing
    return _close(plan, seal)


def with_precision(plan: Plan, model, precision: str, tokens: float | None = None) -> Plan:
    """The Linears' precision as the request asks it (``autoplan.precision.request.decide_precision``:
    each module's recipe, or why it stays in high precision), decided at the ``tokens`` rows a
    call the search priced; the plan's notes say what is kept and why."""
    section, notes = decide_precision(plan, model, precision, tokens=tokens)
    plan, seal = _open(plan)
    plan.parallel["precision"] = section
    plan.notes = [n for n in plan.notes if not n.startswith("precision: ")] + notes
    return _close(plan, seal)


def with_fsdp_options(plan: Plan, *, reshard_after_forward: bool | None = None, prefetch: int | None = None) -> Plan:
    """FSDP2's overlap options on an FSDP plan (``parallelisms.data``): ``prefetch`` blocks gathered
    ahead, and ``reshard_after_forward=False`` -- every block's parameters stay gathered from its
    forward to its backward: the backward all-gathers go from the plan's collectives (the FSDP
    dimensions are those its gradients reduce-scatter on) and what they gathered is held instead,
    the memory term ``gathered_params`` (one gather per unit, less the shard the rank holds)."""
    if reshard_after_forward is None and prefetch is None:
        return plan
    if plan_dp_mode(plan) != "fsdp" or not plan.fsdp.get("enabled"):
        raise PlanningError(f"FSDP options (reshard_after_forward={reshard_after_forward}, prefetch={prefetch}) on a "
                            f"plan whose data parallel is {plan_dp_mode(plan)}; valid: an FSDP plan")
    pipe = plan.pipeline or {}
    if reshard_after_forward is False and int(pipe.get("pp") or 1) > 1:
        # a pipeline's FSDP actions (hyper_parallel.core.pipeline_parallel.fsdp_actions) decide when its
        # stages gather on their own schedule; kept-gathered stages are not priced or counted yet
        raise PlanningError(f"reshard_after_forward=False with pp={pipe['pp']}: a pipeline's stages gather on its "
                            "schedule's own UNSHARD/RESHARD actions; valid: pp=1, or keep reshard_after_forward")
    plan, seal = _open(plan)
    options = {k: v for k, v in (("reshard_after_forward", reshard_after_forward), ("prefetch", prefetch))
               if v is not None}
    plan.fsdp = dict(plan.fsdp, **options)
    if reshard_after_forward is False:
        m = max(1, int(pipe.get("microbatches") or 1))
        shape = dict(zip(plan.mesh["names"], plan.mesh["shape"]))

        def regathers(rows: list[dict]) -> tuple[list[dict], float]:
            dims = {r["mesh_dim"] for r in rows if r["kind"] == "reduce_scatter" and r["phase"] == "backward"
                    and r["mesh_dim"] != plan.tp_dim}
            gone = [r for r in rows if r["kind"] == "all_gather" and r["phase"] == "backward" and r["mesh_dim"] in dims]
            held = sum(r["bytes"] * r["count"] * (1 - 1 / _degree(plan, shape, r["mesh_dim"])) for r in gone) / m
            return [r for r in rows if r not in gone], held

        plan.predictions["collectives"], held = regathers(plan.predictions["collectives"])
        mem = {k: v for k, v in plan.predictions["memory_bytes"].items() if k != "total"}
        plan.predictions["memory_bytes"] = _exact(dict(mem, gathered_params=held))
    return _close(plan, seal)


def _degree(plan: Plan, shape: dict, dim: str) -> int:
    """The size of mesh dimension ``dim``: a named one, or the flattened mesh FSDP runs on (its
    gradient or state dimensions, ``flat_name``), the product of their sizes."""
    for dims in (grad_dims(plan), state_dims(plan)):
        if len(dims) > 1 and flat_name(dims) == dim:
            out = 1
            for d in dims:
                out *= int(shape[d])
            return out
    return int(shape.get(dim, 1))


def with_notes(plan: Plan, notes: list[str]) -> Plan:
    plan, seal = _open(plan)
    plan.notes = list(plan.notes) + list(notes)
    return _close(plan, seal)


def fastest_of(plans: list[Plan], label: str) -> Plan:
    """The plan with the shortest predicted step among ``plans`` (meshes of one device count split
    different ways), the others appended to its alternatives as ``"<label> {mesh}"`` rows."""
    plans = sorted(plans, key=lambda p: p.predictions["step_s"])
    best, seal = _open(plans[0])
    best.alternatives = list(best.alternatives) + [
        {"name": f"{label} {dict(zip(p.mesh['names'], p.mesh['shape']))}", "step_s": p.predictions["step_s"],
         "comm_s": p.predictions["comm_s"], "memory_bytes": p.predictions["memory_bytes"].get("total")}
        for p in plans[1:]]
    return _close(best, seal)


def to_hsdp(sub: Plan, replicate: int, global_batch: int) -> Plan:
    """The HSDP plan with a dp_replicate dimension of ``replicate`` in front of ``sub``'s mesh:
    ``sub`` is the plan of one replica (FSDP over its dp dimension -- named dp_shard, dp, ... --
    at batch global_batch / replicate), pipelined or not. Its rows gain the dp_replicate
    all-reduces (one per reduce-scatter over the dp dimension, per pipeline rank for a pipeline)
    and their exposed time. ``sub`` is not modified."""
    names, shape = list(sub.mesh["names"]), list(sub.mesh["shape"])
    if sub.dp_dim is None or not sub.fsdp.get("enabled") or sub.fsdp.get("replicate_dim"):
        raise PlanningError(f"to_hsdp: the replica plan must use FSDP over its dp dimension (and not be HSDP "
                            f"already); got dp_dim={sub.dp_dim!r}, fsdp={sub.fsdp}")
    if DP_REPLICATE in names:
        raise PlanningError(f"to_hsdp: the replica plan's mesh {names} already has {DP_REPLICATE!r}")
    shard = shape[names.index(sub.dp_dim)]
    plan = draft(sub)
    plan.mesh = dict(sub.mesh, shape=[replicate] + shape, names=[DP_REPLICATE] + names)
    spec = ParallelDims.from_dict(plan.mesh)

    def with_replicate(rows: list[dict]) -> tuple[list[dict], float]:
        extra = hsdp_replicate_rows(rows, shard, replicate, sub.dp_dim)
        seconds = hsdp_replicate_time(rows, extra, spec, float(sub.predictions["compute_s"]), sub.dp_dim)
        return merged_rows(Collective.from_row(r) for r in list(rows) + extra), seconds

    pred = dict(sub.predictions)
    pred["collectives"], extra_s = with_replicate(pred["collectives"])
    pred["step_s"] = float(pred["step_s"]) + extra_s
    pred["comm_s"] = float(pred["comm_s"]) + extra_s
    plan.predictions = pred
    if plan.pipeline and plan.pipeline.get("rank_collectives"):
        plan.pipeline = dict(plan.pipeline, rank_collectives=[with_replicate(rows)[0]
                                                              for rows in plan.pipeline["rank_collectives"]])
    plan.fsdp = dict(sub.fsdp, replicate_dim=DP_REPLICATE, replicate=int(replicate), shard=int(shard))
    plan.batch = dict(sub.batch, global_batch=int(global_batch))
    plan.notes = list(sub.notes) + [
        f"HSDP: {DP_REPLICATE}={replicate} x {sub.dp_dim}={shard}: parameters, gradients and optimizer "
        f"state sharded over {sub.dp_dim}; one all-reduce per FSDP unit over {DP_REPLICATE} "
        f"({extra_s:.4g} s/step exposed)"]
    plan.timing = dict(sub.timing)
    return sealed(plan)
