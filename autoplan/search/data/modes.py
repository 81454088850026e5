"""Data-parallel mode, recomputation and mixed precision written into a Plan, with the exact
collectives and per-rank state bytes the runtime then has.

``autoplan()`` solves the tensor-parallel styles under FSDP or replicated dp and no or full
recomputation; the whole-cluster search also prices ZeRO-1 and selective recomputation
(``CostContext.dp_mode`` / ``recompute``). This module turns a plan into the chosen mode the way
the runners apply it (``autoplan.plan.runner``, ``pipeline_runner``), so ``verify``'s dry run can
hold the plan to it byte for byte:

- ``zero1``: the runner's :class:`~autoplan.parallelisms.data.Zero1` reduce-scatters one flat
  fp32 gradient buffer (this rank's TP-local parameters in registration order, padded to a
  multiple of dp) and all-gathers the updated parameters in their dtype: two rows of the padded
  size; optimizer state and fp32 master weights sharded over dp.
- ``selective``: the attention module of every repeated block recomputes its own ops
  (``autoplan.parallelisms.recompute``); no collective is repeated.
- gradient accumulation (one stage, ``pipeline.microbatches = m > 1``): the runner's
  ``forward_backward`` repeats every forward and backward collective (TP, cp, ep, FSDP2's
  gathers and reduce-scatters) once per micro-batch; what ``Runner.data_parallel_step`` issues
  after the last one (replicated dp's all-reduce, ZeRO-1's pair, the all-reduce of parameters
  left out of FSDP, expert parallel's gradient sync) stays once per step.
- mixed precision (FSDP plans with 16-bit compute): ``fsdp.mixed_precision`` is FSDP2's policy,
  bf16 parameters for compute and fp32 gradient reduction. The sharded parameters are then the
  fp32 master weights the optimizer updates (4 bytes each), gradients are reduce-scattered in
  fp32 (4 bytes), all-gathers stay 16-bit; the per-element state total is unchanged
  (4 + 4 + 8 = 2 + 2 + 12 bytes).
"""
from __future__ import annotations

from typing import Sequence

from autoplan.capture.ir import ModelGraph
from autoplan.errors import PlanningError
from autoplan.parallelisms.data import flat_name, grad_dims, state_dims
from autoplan.plan.plan import Plan
from autoplan.search.pricing.sharding import param_shards
from autoplan.search.units.structure import ModelStructure
from hyper_parallel.core.collective import Collective

MIXED_PRECISION = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
REDUCE_BYTES = 4   # gradients are reduced in fp32 under mixed precision (FSDP2 policy, ZeRO-1)


def attention_patterns(structure: ModelStructure) -> list[str]:
    """Module patterns of the attention of every repeated block (``layers.*.attention``)."""
    return [f"{b.prefix}.*.{b.attention.rel}" for b in structure.blocks if b.attention is not None]


def with_recompute(plan: Plan, structure: ModelStructure, mode: str) -> Plan:
    """Set the plan's recomputation: ``none`` | ``selective`` | ``full``."""
    if mode not in ("none", "selective", "full"):
        raise PlanningError(f"recompute={mode!r} is not one of none, selective, full")
    plan.activation_checkpointing = mode == "full"
    plan.recompute = {"mode": "selective", "modules": attention_patterns(structure)} if mode == "selective" else {}
    return plan


def zero1_rows(graph: ModelGraph, styles: dict, tp: int, block_prefixes: list[str], dp: int, dp_dim: str,
               units: list[str] | None = None, also: Sequence[str] = ()) -> tuple[list[dict], int]:
    """(the two ZeRO-1 collectives of one step, parameter elements on this rank) for the
    parameters of ``units`` (module FQN prefixes; None: all) and those named in ``also`` (a tied
    parameter's copy a later stage holds, counted under its first name)."""
    shards = param_shards(graph, styles, tp, block_prefixes)
    if units is not None:
        shards = [s for s in shards if s.fqn in also or any(s.fqn.startswith(u + ".") for u in units)]
    n = sum(s.fsdp_local_numel(1) for s in shards)
    padded = -(-n // dp) * dp
    pbytes = shards[0].dtype_bytes if shards else 4
    rows = [Collective("reduce_scatter", "backward", padded * REDUCE_BYTES, dim=dp_dim).to_row(),
            Collective("all_gather", "backward", padded * pbytes, dim=dp_dim).to_row()]
    return rows, n


def with_dp_mode(plan: Plan, graph: ModelGraph, structure: ModelStructure, mode: str,
                 optimizer_bytes_per_element: int) -> Plan:
    """Rewrite a one-stage plan made with replicated dp (``fsdp=False``) into ``mode``.

    ``fsdp`` and ``replicate`` plans come out of ``autoplan()`` as they are; ``zero1`` replaces
    the replicated all-reduce by ZeRO-1's reduce-scatter + all-gather and shards the optimizer
    state (fp32 master weights included) over dp."""
    if mode not in ("fsdp", "zero1", "replicate"):
        raise PlanningError(f"dp_mode={mode!r} is not one of fsdp, zero1, replicate")
    dp_dim = plan.dp_dim
    dp = dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(dp_dim, 1) if dp_dim else 1
    if mode != "zero1" or dp <= 1:
        plan.fsdp = dict(plan.fsdp, mode=mode if dp > 1 else plan.fsdp.get("mode", "replicate"))
        return plan
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
    return plan


def with_accumulation(plan: Plan, m: int) -> Plan:
    """The collectives of a one-stage plan whose step is ``m`` micro-batches of gradient
    accumulation, from the rows of one micro-batch's step (see the module docstring)."""
    if m <= 1:
        return plan
    mode = plan.fsdp.get("mode") or ("fsdp" if plan.fsdp.get("enabled") else "replicate")
    ep_dim = (plan.parallel.get("ep") or {}).get("dim")
    flat = flat_name(grad_dims(plan))   # the all-reduce of FSDP's left-out parameters runs on it

    def once_per_step(r: dict) -> bool:
        if mode in ("replicate", "zero1") and r["mesh_dim"] == plan.dp_dim:
            return True
        return r["kind"] == "all_reduce" and r["phase"] == "backward" and (
            r["mesh_dim"] == ep_dim or (mode == "fsdp" and r["mesh_dim"] == flat))

    plan.predictions["collectives"] = [r if once_per_step(r) else dict(r, count=r["count"] * m)
                                       for r in plan.predictions["collectives"]]
    return plan


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
    pbytes = 2
    scale = REDUCE_BYTES / pbytes
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
    elements = mem.get("params", 0.0) / pbytes
    mem.update(params=elements * 4, grads=elements * 4, optimizer=elements * 8)
    plan.predictions["memory_bytes"] = _exact(mem)
    if plan.pipeline and plan.pipeline.get("rank_param_bytes"):
        plan.pipeline["rank_param_bytes"] = [int(b) * 4 // pbytes for b in plan.pipeline["rank_param_bytes"]]
    plan.fsdp = dict(plan.fsdp, mixed_precision=dict(MIXED_PRECISION, param_dtype=dtype))
    return plan
