"""plan_cluster(model, devices, ...) -> Plan: the whole plan for N devices.

Given only a device count, a hardware profile and a global batch, choose dp x pp x tp (and cp for
long sequences or ep for MoE models: ``autoplan/search/mesh/dims.py``), FSDP or
replicated data parallel, activation checkpointing, the micro-batch size and count, the pipeline
schedule and its cuts, and every module's tensor-parallel style, and say what the runners-up
would cost. The search is ``autoplan.search.mesh.search``; this module turns its winner into a
Plan: the TP styles come from ``autoplan()`` on the winning mesh (so ``plan.apply`` and
``verify`` see the same styles the search priced), and ``plan.pipeline`` carries the stages.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import torch

from autoplan import assembler
from autoplan.mesh_plan import mesh_plan_draft
from autoplan.arguments import UNBOUNDED, check_batch_fits_model, check_model, check_pipeline_depth, positive_int
from autoplan.errors import InvalidArgumentError
from autoplan.parallelisms.data import flat_name
from autoplan.plan.plan import Plan
from autoplan.request import PlanRequest
from autoplan.search.context.cost import LOSS_BYTES
from autoplan.capture.inputs import meta_view
from autoplan.search.mesh.candidates import MESH_NAMES, Candidate, ranked_alternatives
from autoplan.search.mesh.search import ClusterSearch, search_dtype
from autoplan.search.experts.memory import memory_breakdown
from autoplan.search.experts.pipeline import ep_layer_rows, ep_sync_row, expert_shards
from autoplan.search.pipeline.search import fsdp_gathers, stage_bounds
from autoplan.search.data.modes import REDUCE_BYTES, zero1_rows
from autoplan.search.pipeline.stage_params import param_homes, tied_copy_state, tied_holders
from autoplan.search.pricing.sharding import param_shards
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, schedule_facts
from hyper_parallel.core.pipeline_parallel.schedules import AGREEMENT_BYTES
from autoplan.search.pipeline.tower_plan import add_tower, tower_params
from autoplan.search.units.targets import block_members, option_units
from hyper_parallel.core.collective import Collective, merged_rows
from cost_models.hardware import load_hardware
from cost_models.published_mfu import StepTerms, mfu_note, predicted_mfu

log = logging.getLogger(__name__)
# the keywords plan_cluster takes beyond autoplan's: autoplan(model, N, ...) forwards exactly these
CLUSTER_ONLY = frozenset({"devices_per_node", "constraints", "schedules", "microbatch_sizes", "virtual_stages",
                          "graphs", "alternatives", "max_simulations", "time_budget_s"})


def _shards(search: ClusterSearch, best: Candidate, styles: dict, ep: dict | None) -> list:
    """Rank 0's parameter shapes after TP and (with an ep dimension) ExpertParallel."""
    st = search.structure(best.b, best.cp)
    shards = param_shards(search.graph(best.b, best.cp), styles, best.tp, [g.prefix for g in st.blocks])
    return expert_shards(shards, search.moe_groups, ep, best.ep, best.tp) if best.ep > 1 else shards


def _stage_params(search: ClusterSearch, best: Candidate) -> tuple[dict[str, set[int]], dict[str, str]]:
    """(tied parameter -> the stages holding a copy, parameter under no unit -> the unit it lives
    with) for the candidate's cuts (``autoplan.search.pipeline.stage_params``); a VL tower's parameters are
    the tower's (``add_tower`` counts them), not homed with a unit."""
    names, graph = search.unit_names, search.graph(best.b, best.cp)
    tied = tied_holders(graph, names, stage_bounds(best.choice.starts, len(names)))
    modules, params = tower_params(search.meta, graph, names)
    homes = {f: u for f, u in param_homes(graph, names).items()
             if f not in params and not any(f.startswith(m + ".") for m in modules)}
    return tied, homes


def _fsdp_state(search: ClusterSearch, best: Candidate, mode: str = "fsdp") -> tuple[str, str, int]:
    """(FSDP's gradient dimension: dp, or dp_cp under cp; the dimension of its non-expert units;
    the ep degree those are sharded over too). With an ep dimension under FSDP (or ZeRO-1:
    ``mode``) the runners shard every non-expert parameter over the flattened dp (x cp) x ep
    mesh, the experts over dp (``parallelisms.data.state_mesh``)."""
    dim = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.cp, best.ep).dp_dim
    if best.ep == 1 or best.dp_mode != mode:
        return dim, dim, 1
    names = list(search.spec(best.dp, best.pp, best.tp, best.cp, best.ep).names)
    return dim, flat_name(tuple(n for n in names if n in ("dp", "cp", "ep"))), best.ep


def _fsdp_rows(search: ClusterSearch, best: Candidate, rank: int, styles: dict, ep: dict | None = None) -> list[dict]:
    """FSDP2 traffic of pipeline rank ``rank``, exactly as the pipeline runner wraps it: every
    block of its stages is a unit, each stage root holds the rest (embedding, norm, head); with
    an ep dimension each experts container is a unit of its own over dp, the rest over dp x ep."""
    c = best.choice
    shards = _shards(search, best, styles, ep)
    names = search.unit_names
    s2r = schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank
    dim, state_dim, ep_deg = _fsdp_state(search, best)
    units: dict[tuple, int] = {}
    unit_stage: dict[str, int] = {}
    tied, homes = _stage_params(search, best)
    for s, (a, b) in enumerate(stage_bounds(c.starts, len(names))):
        if s2r[s] != rank:
            continue
        for sh in shards:
            if sh.fqn in tied:   # left out of FSDP: the schedule reduces it (stage_params)
                continue
            if homes.get(sh.fqn) in names[a:b] or any(sh.fqn.startswith(u + ".") for u in names[a:b]):
                unit_stage[sh.experts or sh.unit] = s
                key = (1, sh.experts or sh.unit, dim if sh.experts else state_dim) if sh.unit else \
                    (0, f"stage{s}", state_dim)
                units[key] = units.get(key, 0) + sh.fsdp_padded_numel(sh.fsdp_degree(best.dp * best.cp, ep_deg)) \
                    * sh.dtype_bytes
    gathers = fsdp_gathers(c.schedule, c.p, c.m, c.v)
    rows = []
    for (is_block, unit, d), nbytes in sorted(units.items()):
        if d == dim and best.dp * best.cp == 1:   # an experts container over one dp rank: nothing to send
            continue
        stage = unit_stage[unit] if is_block else int(unit[5:])
        # a block (and an experts container in it) is resharded after each forward (gathered
        # again when next needed); the stage root stays unsharded for the whole step
        rows += [("all_gather", "forward", nbytes, gathers[stage] if is_block else 1, d),
                 ("reduce_scatter", "backward", nbytes, 1, d)]
    return [Collective(k, p, b, n, d).to_row() for k, p, b, n, d in rows]


def _rank_param_bytes(search: ClusterSearch, best: Candidate, styles: dict, ep: dict | None = None) -> list[int]:
    """Parameter bytes each pipeline rank holds after TP, EP and FSDP (tied parameters once), one
    pass over the parameter shards for all ranks."""
    c = best.choice
    shards = _shards(search, best, styles, ep)
    names = search.unit_names
    s2r = schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank
    rank_of = {u: s2r[s] for s, (a, b) in enumerate(stage_bounds(c.starts, len(names))) for u in names[a:b]}
    d = best.dp * best.cp if best.fsdp else 1
    tied, homes = _stage_params(search, best)
    ep_deg = _fsdp_state(search, best)[2]
    out = [0] * c.p
    for sh in shards:
        if sh.fqn in tied:   # a copy on every holding stage's rank, whole over dp (left out of FSDP)
            for r in {s2r[s] for s in tied[sh.fqn]}:
                out[r] += sh.fsdp_local_numel(1) * sh.dtype_bytes
            continue
        owners = {r for u, r in rank_of.items() if sh.fqn.startswith(u + ".") or homes.get(sh.fqn) == u}
        for r in owners:
            out[r] += sh.fsdp_local_numel(sh.fsdp_degree(d, ep_deg)) * sh.dtype_bytes
    return out


def _one_stage_tower_params(search: ClusterSearch, best: Candidate, styles: dict, ep: dict | None, pipeline: dict,
                            mem: dict[str, float]) -> dict[str, float]:
    """``mem`` of a one-stage plan of a VL model with its parameters counted exactly: the
    pipeline units' exact shards and the vision tower's. The TP options' memory leaves out the
    tower's block groups (no pipeline unit holds them; pp > 1 adds the tower in add_tower) and
    shards every parameter of a sharded unit (a row-parallel bias, Qwen3's q/k norms stay whole),
    so verify's dry run counted 21 MB more than predicted for Qwen3-VL at tp=4. Gradients hold as
    many elements as the parameters, so they move by as much. A text model (no tower) is as it was."""
    modules, params = tower_params(search.meta, search.graph(best.b, best.cp), search.unit_names)
    if not modules and not params:
        return mem
    held = _param_bytes_under(search, best, styles, ep, modules, params)
    pipeline["rank_param_bytes"][0] += held
    delta = pipeline["rank_param_bytes"][0] - mem.get("params", 0.0)
    return dict(mem, params=mem.get("params", 0.0) + delta, grads=mem.get("grads", 0.0) + delta)


def _param_bytes_under(search: ClusterSearch, best: Candidate, styles: dict, ep: dict | None,
                       prefixes: list[str], params: list[str] = (), over_dp: bool = True) -> int:
    """Parameter bytes one rank holds of the modules under ``prefixes``, and of the parameters named
    in ``params``, after TP, EP and -- ``over_dp``: they are FSDP-sharded, not a replica -- FSDP."""
    d = best.dp * best.cp if best.fsdp and over_dp else 1
    named = set(params)
    ep_deg = _fsdp_state(search, best)[2]
    return sum(sh.fsdp_local_numel(sh.fsdp_degree(d, ep_deg)) * sh.dtype_bytes for sh in _shards(search, best, styles, ep)
               if sh.fqn in named or any(sh.fqn.startswith(p + ".") for p in prefixes))


def zero1_ep_rows(search: ClusterSearch, best: Candidate, styles: dict, ep: dict | None, units: list[str] | None = None,
                  also: Sequence[str] = ()) -> tuple[list[dict], int]:
    """ZeRO-1 of a plan with an ep dimension as the runtime issues it (``parallelisms.data.zero1_of``):
    the non-expert parameters in one padded flat buffer over the flattened dp x ep mesh, this
    rank's expert shards in another over dp (none at dp 1): (rows, optimizer elements on this
    rank). ``units`` / ``also``: a pipeline rank's units and the tied copies it holds (None: all)."""
    shards = _shards(search, best, styles, ep)
    if units is not None:
        shards = [s for s in shards if s.fqn in also or any(s.fqn.startswith(u + ".") for u in units)]
    dense = sum(s.fsdp_local_numel(1) for s in shards if not s.experts)
    experts = sum(s.fsdp_local_numel(1) for s in shards if s.experts)
    element = shards[0].dtype_bytes if shards else 4
    rows, held = [], 0
    for n, ways, dim in ((dense, best.dp * best.ep, _fsdp_state(search, best, "zero1")[1]), (experts, best.dp, "dp")):
        padded = -(-n // ways) * ways
        held += padded // ways
        if ways > 1 and n:
            rows += [Collective("reduce_scatter", "backward", padded * REDUCE_BYTES, dim=dim).to_row(),
                     Collective("all_gather", "backward", padded * element, dim=dim).to_row()]
    return rows, held


def _flat_dp_rows(search: ClusterSearch, best: Candidate, rank: int, styles: dict, ep: dict | None = None
                  ) -> list[dict]:
    """Replicated dp (one flat all-reduce) or ZeRO-1 (reduce-scatter + all-gather of one padded
    flat buffer; with ep two: ``zero1_ep_rows``) of the parameters pipeline rank ``rank`` holds,
    as the pipeline runner issues them."""
    c = best.choice
    names = search.unit_names
    s2r = schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank
    bounds = stage_bounds(c.starts, len(names))
    mine = [u for s, (a, b) in enumerate(bounds) if s2r[s] == rank for u in names[a:b]]
    st = search.structure(best.b, best.cp)
    graph = search.graph(best.b, best.cp)
    tied, homes = _stage_params(search, best)
    copies = [f for f, stages in tied.items() if any(s2r[s] == rank for s in stages)]
    copies += [f for f, home in homes.items() if home in mine]   # params under no unit
    if best.ep > 1 and best.dp_mode == "zero1":
        return zero1_ep_rows(search, best, styles, ep, mine, copies)[0]
    rows, n = zero1_rows(graph, styles, best.tp, [g.prefix for g in st.blocks], best.dp, "dp", mine, copies)
    if best.dp_mode == "zero1":
        return rows
    return [Collective("all_reduce", "backward", n * st.dtype_bytes, dim="dp").to_row()]


def _rank_rows(search: ClusterSearch, best: Candidate, rank: int, styles: dict | None = None,
               ep: dict | None = None) -> tuple[list[dict], dict[str, float]]:
    """Collectives and memory of pipeline rank ``rank``: the TP collectives of its units once per
    micro-batch, the dp collectives once per step, and the P2P sends of its stage boundaries;
    with an ep dimension (``ep``: the plan's ``parallel.ep``) its MoE layers' all-to-alls per
    micro-batch and the gradient all-reduce over ep once per step."""
    from collections import defaultdict

    c = best.choice
    options, layout = search.tp_solution(best.tp, best.b, best.recompute, best.cp, best.ep)
    ctx = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.cp, best.ep)
    names = search.unit_names
    index = {n: i for i, n in enumerate(names)}
    st = search.structure(best.b, best.cp)
    head_i = index.get(st.head.fqn, len(names) - 1) if st.head else len(names) - 1
    emb_i = index.get(st.embedding.fqn, 0) if st.embedding else 0
    norm_i = index.get(st.final_norms[0], head_i) if st.final_norms else head_i
    s2r = schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank
    mine, stage_of = set(), {}
    for s, (a, b) in enumerate(stage_bounds(c.starts, len(names))):
        stage_of.update({i: s for i in range(a, b)})
        if s2r[s] == rank:
            mine.update(range(a, b))
    # split-backward schedules on FSDP stages run the input-gradient pass (I) with autograd.grad
    # and the weight pass (W) as a whole backward again (FSDP's own hooks must reduce the weight
    # gradients), so a stage whose inputs need gradients (every stage but the first) issues its
    # backward TP collectives twice -- except those that only reduce a weight's gradient, which
    # the input pass never reaches
    twice = schedule_facts(c.schedule).split_backward and best.fsdp and best.dp * best.cp > 1
    agg: dict[tuple, int] = defaultdict(int)
    mem = defaultdict(float)
    for o in options:
        targets = option_units(o, names, index, emb_i, norm_i, head_i, block_members(st))
        if not targets:
            continue
        k = sum(1 for t in targets if t in mine)
        if not k:
            continue
        for col in o.collectives(ctx):
            dim = "tp" if col.dim == "tp" else col.dim
            if dim not in MESH_NAMES or ctx.topology[dim].size == 1 or col.nbytes <= 0:
                continue
            if dim == "dp":
                continue  # exact rows of the runtime's dp collectives: _fsdp_rows / _flat_dp_rows
            w = sum(2 if twice and col.phase == "backward" and not col.weight_grad and stage_of[t] > 0 else 1
                    for t in targets if t in mine)
            per = col.count * w // len(targets)
            agg[(col.kind, dim, col.phase, int(col.nbytes))] += per * (c.m if dim == "tp" else 1)
        for key, v in o.memory(ctx).items():
            mem[key] += v * k / len(targets)
    extra = tied_copy_state(options, st, ctx) if c.p > 1 else None
    for unit, add in zip((emb_i, head_i), extra or ()):   # a tied head's copy on its stage (stage_params)
        if unit in mine:
            for key, v in add.items():
                mem[key] += v
    if c.p > 1:
        units, _ = search.unit_costs(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.b, best.cp, best.ep)
        hidden = st.hidden_bytes
        # a sequence-sharded stream is sharded from the first block's input on (the entry style);
        # a boundary before it carries the embedding's whole output
        entry = next((o for o in options if o.slot == "entry" and o.strategy.styles), None)
        sharded_from = option_units(entry, names, index, emb_i, norm_i, head_i,
                                    block_members(st))[0] if entry is not None else 0
        starts = list(c.starts)

        def boundary_bytes(s: int) -> int:   # the boundary in front of stage s
            return int(hidden / (best.tp if layout == "S" and starts[s] > sharded_from else 1))

        for s in range(len(s2r)):
            if s2r[s] != rank:
                continue
            # activations go up and gradients come back: a send and a receive per micro-batch
            # on each side of every boundary this stage has with another rank
            fronts = ([s + 1] if s + 1 < len(s2r) and s2r[s + 1] != rank else []) + \
                ([s] if s > 0 and s2r[s - 1] != rank else [])
            for front in fronts:
                agg[("send_recv", "pp", "forward", boundary_bytes(front))] += c.m
                agg[("send_recv", "pp", "backward", boundary_bytes(front))] += c.m
        # the runtime agrees on the input signature and the schedule's shape once per step
        # (one small int64 all-reduce on pp)
        agg[("all_reduce", "pp", "forward", AGREEMENT_BYTES)] += 1
        # each tied parameter's gradient summed over the pipeline group (every pp rank takes part),
        # and under FSDP averaged over dp (it is left out of FSDP)
        tied, _ = _stage_params(search, best)
        for sh in (sh for sh in _shards(search, best, styles, ep) if sh.fqn in tied):
            nbytes = sh.fsdp_local_numel(1) * (_tied_grad_bytes(best, st) or sh.dtype_bytes)
            agg[("all_reduce", "pp", "backward", nbytes)] += 1
            if best.fsdp and best.dp * best.cp > 1:
                agg[("all_reduce", ctx.dp_dim, "backward", nbytes)] += 1
        if best.cp > 1:
            _add_cp_rows(agg, search, best, rank, mine, stage_of, twice)
        if best.dp * best.cp > 1 or (best.ep > 1 and best.dp_mode != "replicate"):   # (over ep at dp 1 too)
            rows = _fsdp_rows(search, best, rank, styles, ep) if best.fsdp else \
                _flat_dp_rows(search, best, rank, styles, ep)
            for row in rows:
                agg[(row["kind"], row["mesh_dim"], row["phase"], row["bytes"])] += row["count"]
        if best.ep > 1:
            _add_ep_rows(agg, search, best, [names[i] for i in sorted(mine)], stage_of, index, twice, styles, ep)
    inflight = c.peak_inflight[rank] / max(1, sum(1 for r in s2r if r == rank))
    mem["activations"] *= inflight
    rows = merged_rows(Collective(k, p, b, n, d) for (k, d, p, b), n in agg.items())
    return rows, dict(mem)


def _tied_grad_bytes(best: Candidate, st) -> int:
    """Bytes per element of a tied-across-stages parameter's gradient as the runtime reduces it:
    16-bit FSDP keeps fp32 master weights (``with_mixed_precision``), a tied copy's gradient too
    (it is left out of FSDP); 0 elsewhere: the parameter's own dtype."""
    return REDUCE_BYTES if best.fsdp and best.dp * best.cp > 1 and st.dtype_bytes < REDUCE_BYTES else 0


def _add_ep_rows(agg: dict, search: ClusterSearch, best: Candidate, mine: list[str], stage_of: dict, index: dict,
                 twice: bool, styles: dict, ep: dict | None) -> None:
    """Expert parallel on one pipeline rank (units ``mine``): every MoE layer's ExpertParallel
    collectives per micro-batch (the forward ones again in backward under full recomputation;
    backward twice where split-backward FSDP stages run it twice, as the TP rows), and the
    all-reduce over ep of its non-expert gradients once per step."""
    c = best.choice
    st = search.structure(best.b, best.cp)
    per_unit = ep_layer_rows(search.moe_groups, ep, tokens=best.b * search.seq, dtype_bytes=st.dtype_bytes,
                             ep=best.ep, tp=best.tp)
    for u in mine:
        rows = list(per_unit.get(u, ()))
        if best.recompute == "full":
            rows += [dataclasses.replace(col, phase="backward") for col in rows if col.phase == "forward"]
        for col in rows:
            w = 2 if twice and col.phase == "backward" and stage_of[index[u]] > 0 else 1
            agg[(col.kind, col.dim, col.phase, int(col.nbytes))] += col.count * w * c.m
    if best.dp_mode == "zero1":   # ZeRO-1 over dp x ep has averaged every non-expert gradient
        return
    tied = _stage_params(search, best)[0] if best.pp > 1 else {}
    sync = ep_sync_row(_shards(search, best, styles, ep), search.moe_groups, ep, mine,
                       best.dp * best.cp if best.fsdp else 1, "ep", fsdp=best.fsdp, tied=tied,
                       stages={stage_of[index[u]] for u in mine}, tied_bytes=_tied_grad_bytes(best, st))
    if sync is not None:
        agg[(sync.kind, sync.dim, sync.phase, int(sync.nbytes))] += 1


def _add_cp_rows(agg: dict, search: ClusterSearch, best: Candidate, rank: int, mine: set, stage_of: dict,
                 twice: bool) -> None:
    """Context parallel on pipeline rank ``rank``: each of its blocks' attention exchange per
    micro-batch (backward twice where split-backward FSDP stages run it twice, as the TP rows),
    and ``cp_cross_entropy``'s 16-byte all-reduce per micro-batch on the rank of the last stage."""
    c = best.choice
    per_layer, loss_dim = search.cp_rows(best)
    names = search.unit_names
    index = {n: i for i, n in enumerate(names)}
    members = block_members(search.structure(best.b, best.cp))
    for gid, rows in per_layer.items():
        units = [index[u] for u in members.get(gid, ()) if u in index and index[u] in mine]
        for col in rows:
            w = sum(2 if twice and col.phase == "backward" and stage_of[t] > 0 else 1 for t in units)
            if w:
                agg[(col.kind, col.dim, col.phase, int(col.nbytes))] += col.count * w * c.m
    s2r = schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank
    if s2r[-1] == rank:
        agg[("all_reduce", loss_dim, "forward", LOSS_BYTES)] += c.m


def plan_cluster(model: torch.nn.Module, devices: int, *, batch: tuple[int, int], hardware: str | None = None,
                 inputs: Any = None, memory_limit: float | None = None, dtype: torch.dtype | None = None,
                 fsdp: bool | None = None, allow_replicated_units: bool = True,
                 activation_checkpointing: bool | None = None, sequence_parallel: bool | None = None,
                 graph=None, styles: dict | None = None,
                 devices_per_node: int | None = None, constraints: dict | None = None,
                 schedules: Sequence[str] = SCHEDULE_NAMES, microbatch_sizes: Sequence[int] = (1, 2, 4),
                 virtual_stages: Sequence[int] = (2,), graphs: dict | None = None, alternatives: int = 10,
                 max_simulations: int = 400, time_budget_s: float | None = None,
                 compile: bool | str = False, overlap: str | None = None, precision: str | None = None) -> Plan:
    """The best whole plan for ``devices`` devices.

    Takes :func:`autoplan.autoplan`'s keywords (``autoplan(model, N, ...)`` is this function) and
    its own; an unknown keyword is a TypeError. ``fsdp`` and ``activation_checkpointing`` (None:
    searched) restrict the search like the constraints of the same name; ``inputs``, ``graph``
    and ``styles`` cannot drive a search over micro-batch shapes and meshes and are refused
    (InvalidArgumentError) rather than ignored.

    Args:
        batch: ``(global_batch, seq_len)`` in sequences.
        hardware: hardware profile (default h100_sxm).
        constraints: fix any of ``dp, pp, tp, cp, ep, schedule, microbatches, microbatch_size, fsdp,
            activation_checkpointing, virtual_stages, dp_mode, recompute`` (e.g. ``{"pp": 2}``), and
            ``reshard_after_forward`` / ``prefetch`` (FSDP2's: keep each block gathered from forward to
            backward; gather that many blocks ahead), ``precision``,
            ``expert_parallel`` (True: the ep dimension splits the experts, False: it is data parallel
            with replicated experts; unset: priced), and ``tower_placement`` (a VL model's vision
            tower in a pipeline: "stage0" or "mpipe"; unset: the faster the runtime runs), ``cuts``
            ("even": blocks spread evenly over the stages, as Megatron-Core and AutoModel cut;
            "balanced": the planner's by cost; unset: either). Facts of the runtime a plan is priced
            for where it is not hyper_parallel's (a published run's framework): ``expert_runtime`` (an
            ``ExpertRuntime`` or "deepep" / "deepseek_v3"), ``attention_kernel``, ``loss_bytes_per_logit``.
        microbatch_sizes: sequences per micro-batch to consider (one capture each).
        graphs: ``{micro-batch size: ModelGraph}`` already captured at ``(b, seq_len)``.
        compile: price the step as compiled code runs it (True / "blocks": each repeated block
            compiled on its own, as torchtitan does; "model": the whole model and its loss;
            False / "none": eager); the plan's ``predictions["compile"]`` says which.
        overlap: "async_tp": tensor-parallel collectives of sequence-parallel units priced fused
            with their matmuls (inductor's micro-pipeline TP); ``predictions["overlap"]`` says so.
        precision: as :func:`autoplan.autoplan`'s; ``constraints["precision"]`` is the same setting
            (e.g. ``{"precision": "bf16"}`` keeps every Linear in the model's dtype).
    Raises InfeasiblePlanError when no factorization fits ``memory_limit`` (default: the
    hardware's memory) per device; InvalidArgumentError for a bad argument, before any capture.
    """
    t0 = time.perf_counter()
    who = "plan_cluster"
    check_model(model, who)
    devices = positive_int(devices, "devices", who)
    for name, value in (("inputs", inputs), ("graph", graph), ("styles", styles)):
        if value is not None:
            raise InvalidArgumentError(
                f"{who}: {name}= is not supported with a device count: the search captures the model at each "
                f"micro-batch size itself{' (pass graphs={size: graph})' if name == 'graph' else ''}"
                f"{'; price a hand-written plan on a mesh: autoplan(model, ParallelDims(...), styles=...)' if name == 'styles' else ''}"
                f"{'; give batch=(global_batch, seq_len)' if name == 'inputs' else ''}")
    request = PlanRequest.for_devices(
        who, devices, batch=batch, hardware=hardware, memory_limit=memory_limit, dtype=dtype, fsdp=fsdp,
        allow_replicated_units=allow_replicated_units, activation_checkpointing=activation_checkpointing,
        sequence_parallel=sequence_parallel, devices_per_node=devices_per_node, constraints=constraints,
        schedules=schedules, microbatch_sizes=microbatch_sizes, virtual_stages=virtual_stages,
        alternatives=alternatives, max_simulations=max_simulations, time_budget_s=time_budget_s, compile=compile,
        overlap=overlap, precision=precision)
    check_batch_fits_model(model, request.batch[1], who)
    constraints, space = dict(request.constraints), request.search
    # the search reads the model in its dtype many times: cast in place for the call (no copy of a
    # meta model; meta_view restores it on exit) rather than deep-copying a 126-layer model
    with meta_view(model, search_dtype(load_hardware(request.hardware), request.dtype)) as model:
        search = ClusterSearch(model, devices, request, graphs=graphs)
        check_pipeline_depth(constraints, len(search.unit_names), who)
        cands = search.search(max_simulations=space.max_simulations, time_budget_s=space.time_budget_s)
        t_search = time.perf_counter()
        best = cands[0]
        c = best.choice
        spec = search.spec(best.dp, best.pp, best.tp, best.cp, best.ep)
        # the styles the search priced (its TP ILP), written into the plan by the mesh planner: solving
        # again on the whole mesh can pick another head or stream, and the rows would then not match.
        # With cp / ep the mesh planner also writes their sections (variant, expert styles), priced
        # by the same objects the search priced them with (autoplan/search/mesh/dims.py)
        searched, solver = search.tp_styles(best.tp, best.b, best.recompute, best.cp, best.ep)
        winner = request.replace(memory_limit=UNBOUNDED, dtype=search.dtype, fsdp=best.fsdp,
                                 activation_checkpointing=best.recompute == "full")
        draft = mesh_plan_draft(model, spec, winner, graph=search.graph(best.b, best.cp), styles=searched,
                                prober=search.prober(best.tp, best.b, best.cp), microbatch_size=best.b)
        ctx = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.cp, best.ep)
        if best.ep > 1 and best.dp_mode == "zero1":   # ZeRO-1 over dp x ep (parallelisms.data.zero1_of)
            rows, held = zero1_ep_rows(search, best, draft.styles, draft.parallel.get("ep"))
            draft = assembler.with_zero1_rows(draft, rows, held * ctx.optimizer_bytes_per_element)
        elif best.cp == 1:
            draft = assembler.with_dp_mode(draft, search.graph(best.b, best.cp), search.structure(best.b, best.cp),
                                           best.dp_mode, ctx.optimizer_bytes_per_element)
        elif draft.fsdp.get("enabled"):   # cp plans run FSDP over dp x cp (the search prices no other mode for them)
            draft = assembler.with_fsdp_mode(draft, "fsdp")
        draft = assembler.with_recompute(draft, search.structure(best.b, best.cp), best.recompute)
        if c.p == 1:   # one stage: m micro-batches of gradient accumulation (Runner.forward_backward)
            draft = assembler.with_accumulation(draft, c.m)
        names = search.unit_names
        stages = [names[a:b] for a, b in stage_bounds(c.starts, len(names))]
        s2r = list(schedule_facts(c.schedule).ir(c.p, c.m, c.v).stage_to_rank)
        rank = max(range(c.p), key=lambda r: (c.rank_memory[r], -r))
        styles, ep_section = draft.styles, draft.parallel.get("ep")
        collectives, mem = _rank_rows(search, best, 0, styles, ep_section)
        if c.p == 1:  # one stage: the TP planner's exact rows, x micro-batches (dry_run.verify checks them)
            collectives = draft.predictions["collectives"]
        _, worst_mem = _rank_rows(search, best, rank, styles, ep_section) if rank else (None, mem)
        if c.p == 1 and best.cp > 1:   # the mesh planner's memory: cp's K/V
            worst_mem = {k: v for k, v in draft.predictions["memory_bytes"].items() if k != "total"}
        elif best.ep > 1:   # the busiest rank's memory as the search counted it (one figure per rank) ...
            units, _ = search.unit_costs(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.b, best.cp,
                                         best.ep)
            worst_mem = memory_breakdown(c, units, ctx).terms()
            if c.p == 1:   # ... with one stage's exact state (the plan's shards, which verify checks)
                worst_mem.update({k: v for k, v in draft.predictions["memory_bytes"].items()
                                  if k in ("params", "grads", "optimizer")})
        busy = max(c.busy_s)
        pipeline = {
            "pp": c.p, "schedule": c.schedule, "virtual_stages": c.v, "microbatches": c.m, "microbatch_size": best.b,
            "stages": stages, "cuts": [names[s] for s in c.starts[1:]], "stage_to_rank": s2r,
            "cut_method": c.cut_method, "bubble_fraction": c.bubble_fraction, "peak_inflight": list(c.peak_inflight),
            "per_stage": [{k: int(round(row[k])) if k == "memory_bytes" else row[k]
                           for k in ("stage", "rank", "compute_s", "comm_s", "bubble_s", "memory_bytes")}
                          for row in c.per_stage],
            "collectives_rank": 0,
            # every pipeline rank's exact collectives and parameter bytes: verify dry-runs each rank
            "rank_collectives": [collectives if r == 0 else _rank_rows(search, best, r, styles, ep_section)[0]
                                 for r in range(c.p)] if c.p > 1 else [],
            "rank_param_bytes": _rank_param_bytes(search, best, styles, ep_section),
        }
        # a VL model's vision tower: on stage 0 or spread over the pipeline ranks (MPipe)
        pipeline, notes = add_tower(pipeline, styles, model, search, best, placement=constraints.get("tower_placement"))
        placement = (pipeline.get("preprocess") or {}).get("placement")
        if placement in ("stage0", "mpipe"):
            # stage 0 holds the tower (sharded with it under FSDP); MPipe runs it on every pipeline
            # rank, each holding the whole tower (after its TP) as a replica over dp
            modules, params = tower_params(search.meta, search.graph(best.b, best.cp), search.unit_names)
            held = _param_bytes_under(search, best, styles, ep_section, modules, params, over_dp=placement == "stage0")
            for r in (range(c.p) if placement == "mpipe" else [s2r[0]]):
                pipeline["rank_param_bytes"][r] += held
        elif c.p == 1 and best.cp == 1 and best.ep == 1:
            worst_mem = _one_stage_tower_params(search, best, styles, ep_section, pipeline, worst_mem)
        collectives = pipeline["rank_collectives"][0] if c.p > 1 else collectives
        predictions = {
            "step_s": c.step_s, "compute_s": busy, "comm_s": max(0.0, c.step_s - c.sim_step_s),
            "bubble_s": max(0.0, c.sim_step_s - busy),
            "memory_bytes": dict({k: int(round(v)) for k, v in sorted(worst_mem.items())},
                                 total=sum(int(round(v)) for v in worst_mem.values())),
            "collectives": collectives, "compile": request.compile, "overlap": request.overlap,
        }
        notes += _cluster_notes(search, best)
        plan = assembler.with_cluster_parts(
            draft, pipeline=pipeline, predictions=predictions,
            alternatives=[dict(a, memory_bytes=int(round(a["memory_bytes"])))  # exact bytes in a plan
                          for a in ranked_alternatives(cands, names, space.alternatives)],
            solver={"name": solver.solver, "status": solver.status, "variables": solver.variables,
                    "constraints": solver.constraints, "simulations": search.simulations, "candidates": len(cands)},
            notes=notes, timing={"search_s": t_search - t0, "total_s": time.perf_counter() - t0})
        plan = assembler.with_fsdp_options(plan, reshard_after_forward=constraints.get("reshard_after_forward"),
                                           prefetch=constraints.get("prefetch"))
        # each Linear's precision decided at the rows a call that the search priced it at
        plan = assembler.with_precision(plan, model, request.precision, tokens=best.b * search.seq / best.cp)
        return assembler.finish(plan)


def _cluster_notes(search: ClusterSearch, best: Candidate) -> list[str]:
    """What a cluster plan says about its mesh, its pipeline or accumulation, and its MFU."""
    c = best.choice
    notes = [
        f"mesh {' x '.join(f'{k}={v}' for k, v in best.mesh.items())} ({best.dp_mode} data parallel, "
        f"{best.recompute} recomputation), {c.schedule} with {c.m} micro-batches of "
        f"{best.b}: predicted {c.step_s:.4g} s/step, bubble {c.bubble_fraction:.3f}"] + ([
        "predictions.collectives are pipeline rank 0's (its stages' TP collectives x micro-batches, FSDP "
        "per step, P2P send+recv per boundary and micro-batch); every rank's are in pipeline.rank_collectives "
        "(verify checks each); memory_bytes is the fullest rank's"] if c.p > 1 else [])
    if c.p == 1 and c.m > 1:
        notes.append(
            f"pp=1 with {c.m} micro-batches of {best.b}: gradient accumulation (the runner runs forward and "
            "backward per micro-batch, one micro-batch's activations live, and steps once); "
            "predictions.collectives repeat every forward/backward collective (TP, FSDP's gathers and "
            f"reduce-scatters) {c.m} times, replicated dp / ZeRO-1 reduce once per step")
    if search.pipeline_refusal:
        notes.append(f"pp=1 only: {search.pipeline_refusal}")
    if search.moe_groups:   # why ep plans win or lose here: how the all-to-alls were priced
        notes.append(search.expert_runtime.note())
    note = mfu_bound_note(search, best)
    if note:
        notes.append(note)
    return notes

def mfu_bound_note(search, cand) -> str | None:
    """``cost_models.published_mfu.mfu_note`` for a priced candidate: its MFU by the captured
    graph's forward + backward FLOPs (no recomputation) against the best published for its
    hardware and model class (MoE when the search found expert groups)."""
    g = search.graph(cand.b, cand.cp)
    flops = (g.total_flops() + g.total_flops(backward=True)) * search.gb * cand.cp / cand.b
    ch = cand.choice
    busy = max(ch.busy_s)
    terms = StepTerms(busy, max(ch.sim_step_s - busy, 0.0), max(ch.step_s - ch.sim_step_s, 0.0))
    mfu = predicted_mfu(flops, cand.step_s, search.devices, search.hw.peak(search.dtype))
    return mfu_note(search.hardware, bool(search.moe_groups), mfu, terms)
