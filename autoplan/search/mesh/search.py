"""dp x pp x tp for N devices, searched jointly with the pipeline (cuts, schedule, micro-batches).

Why one search and not levels one after another: the best tensor-parallel degree depends on the
micro-batch size, which depends on dp and on the number of micro-batches the pipeline wants, and
what fits in memory depends on all three. So every factorization N = dp * pp * tp (tp within a
node and innermost, pp next, dp/FSDP outermost) is a group of candidates, and the groups are
visited best-first by a lower bound (the busiest rank's compute with perfectly balanced stages):
once that bound is no better than the best simulated plan, no later group can win.

Pricing reuses the TP planner: the ILP is solved once per (tp degree, micro-batch shape,
activation checkpointing) on a graph captured once per micro-batch shape, and its chosen options
are re-priced per mesh (FSDP vs replicated dp, the dp degree) into per-unit costs
(``pipeline.search.UnitCost``) that the pipeline search cuts and the simulator times.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Sequence

import torch

from autoplan.capture import capture
from autoplan.capture.inputs import meta_model
from autoplan.errors import InfeasiblePlanError, PlanningError
from autoplan.arguments import CONSTRAINT_KEYS, FLOAT8_PRICING
from autoplan.search.mesh.dims import (
    CP_MIN_SEQ, add_cp, add_ep, add_expert_compute, cluster_spec, cp_degrees, cp_layer_rows, ep_degrees,
    experts_split, model_moe_groups,
)
from autoplan.search.context.cost import CPShape, cp_structure, cp_topology, grad_dims
from autoplan.search.pricing.costing import RECOMPUTE, CostContext
from autoplan.search.experts.planning import ExpertPlanning, expert_parallel_constraint
from autoplan.search.experts.search import OUR_EXPERT_RUNTIME, ExpertRuntime, stated_runtime
from cost_models.attention_kernels import with_attention_kernel
from autoplan.parallelisms.data import flat_name
from hyper_parallel.parallel_dims import ParallelDims
from autoplan.search.pipeline.stage_params import add_tied_copy
from autoplan.search.pipeline.search import (
    UnitCost, estimate, even_starts, full_lower_bound, pipeline_candidates, time_choice,
)
from autoplan.search.experts.memory import restate_activations, restate_our_experts
from autoplan.capture.views import module_summary
from autoplan.search.mesh.fixed import evaluate_layout
from autoplan.search.mesh.candidates import (
    Candidate, dp_mode_of, mesh_factorizations, recompute_of,
)
from autoplan.search.pipeline.support import pipeline_layout
from autoplan.search.pipeline.tower_plan import carried_sizes
from autoplan.search.tp.probe import Prober
from autoplan.search.tp.strategies import PACKED_BIAS
from autoplan.search.units.structure import model_structure
from autoplan.search.tp.search import TPSearch, exposed_dp
from autoplan.search.units.targets import block_members, option_units
from autoplan.request import PlanRequest, SearchSpace
from cost_models.fusion import compile_mode
from cost_models.hardware import load_hardware
from cost_models.topology import mesh_topology
from cost_models.overlap import DP_MODES
from hyper_parallel.core.pipeline_parallel import schedule_facts
from hyper_parallel.core.collective import Collective

log = logging.getLogger(__name__)
CP_WITH_PP = True    # cp inside pipelined plans (the pipeline runner shards sequences over cp)


def _tp_key(tp: int, b: int, ac) -> tuple[int, int, str]:
    """Cache key of a TP solution. Selective recomputation repeats no collective: its styles are
    those of no recomputation, which is what autoplan() (none / full only) solves."""
    mode = recompute_of(ac)
    return tp, b, "none" if mode == "selective" else mode


def experts_tp(tp: int, cp: int, ep: int) -> bool:
    """Whether a TP solution plans MoE experts as tensor-parallel units: on a mesh without ep (at
    tp > 1 each expert split on its ffn width, as autoplan() on a fixed mesh does; at tp = 1 whole);
    with ep the expert plan does (expert_plan), and with cp they stay whole."""
    return cp == 1 and ep == 1


def _sol_key(tp: int, b: int, ac, cp: int = 1, ep: int = 1) -> tuple:
    """Cache key of the TP solution of (tp, b, ac) at cp and ep: one per cp degree, and one for
    every ep > 1 (the experts then no TP unit: experts_tp)."""
    return _tp_key(tp, b, ac) + ((cp,) if cp > 1 else ()) + (("ep",) if ep > 1 else ())


def search_dtype(hw, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a search plans in: the one asked, else fp32 on CPU profiles, bf16 elsewhere."""
    return dtype or (torch.float32 if hw.device_type == "cpu" else torch.bfloat16)


class ClusterSearch:
    """State shared by every candidate of one planning call: captured graphs per micro-batch
    shape, TP solutions per (tp, micro-batch, checkpointing), unit costs per mesh."""

    def __init__(self, model: torch.nn.Module, devices: int, request: PlanRequest, *, graphs: dict | None = None,
                 dp_modes: Sequence[str] = DP_MODES, recompute_modes: Sequence[str] = RECOMPUTE,
                 expert_runtime: ExpertRuntime = OUR_EXPERT_RUNTIME, loss_bytes_per_logit: float | None = None):
        # how the runtime moves the experts' tokens (experts.search.ExpertRuntime) and what its loss
        # reads and writes per logit (structure.model_structure): hyper_parallel's unless a caller
        # prices another runtime's published run (benchmarks/moe_published_runs.py)
        # (or as the constraints state them: arguments.check_runtime_facts)
        cons = request.constraints
        self.expert_runtime = stated_runtime(cons.get("expert_runtime", expert_runtime))
        self.loss_bytes_per_logit = cons.get("loss_bytes_per_logit", loss_bytes_per_logit)
        self.request = request
        # what runs compiled, its elementwise chains priced fused (cost_models.fusion)
        self.compile = compile_mode(request.compile, "ClusterSearch")
        self.dp_modes = [dp_mode_of(x) for x in dp_modes]
        self.recompute_modes = [recompute_of(x) for x in recompute_modes]
        self.model, self.devices, self.hardware = model, int(devices), request.hardware
        self.hw = load_hardware(request.hardware)
        if cons.get("attention_kernel"):
            self.hw = with_attention_kernel(self.hw, cons["attention_kernel"])
        self.dpn = int(request.devices_per_node or self.hw.devices_per_node)
        self.gb, self.seq = request.batch
        self.limit = float(request.memory_limit if request.memory_limit is not None else self.hw.usable_memory())
        self.dtype = search_dtype(self.hw, request.dtype)
        self.cons = dict(request.constraints)
        unknown = set(self.cons) - set(CONSTRAINT_KEYS)
        if unknown:
            raise PlanningError(f"plan_cluster: unknown constraints {sorted(unknown)}")
        space = request.search
        self.schedules = [self.cons["schedule"]] if "schedule" in self.cons else list(space.schedules)
        self.virtual = [self.cons["virtual_stages"]] if "virtual_stages" in self.cons else list(space.virtual_stages)
        if self.cons.get("tower_placement") in ("stage0", "own_stage"):   # placed in one rank's stage: one each
            self.schedules = [n for n in self.schedules if schedule_facts(n).stages_per_rank(1) == 1]
            self.virtual = [1]
        self.mb_sizes = [self.cons["microbatch_size"]] if "microbatch_size" in self.cons else list(space.microbatch_sizes)
        if self.seq >= CP_MIN_SEQ and "microbatch_size" not in self.cons:
            self.mb_sizes = [1]   # long sequences: a micro-batch is one sequence (cluster_dims)
        self.allow_replicated, self.sp = request.allow_replicated_units, request.sequence_parallel
        self.expert_parallel = expert_parallel_constraint(request.expert_parallel, request.allow_replicated_units)
        self.graphs: dict[int, Any] = dict(graphs or {})
        self._tp: dict[tuple, tuple] = {}
        self.tp_solver: dict[tuple, Any] = {}   # (tp, b, recompute) -> the TP ILP's SolverInfo
        self._structures: dict[int, Any] = {}
        self._moe_groups: dict[tuple[int, int], list] = {}   # (b, cp) -> MoE groups of that graph
        self._ctx: dict[tuple, Any] = {}
        self._probers: dict[int, Any] = {}
        self._target_cache: dict[tuple, list[int]] = {}   # (slot, owner, in block, cp) -> pipeline units
        self._units: dict[tuple, tuple] = {}
        self._carried: dict[int, int] = {}   # boundary bytes beside the hidden state, per micro-batch size
        self._chosen: dict[tuple, dict] = {}      # TP solution key -> the ILP's chosen options by slot
        self._searches: dict[tuple, TPSearch] = {}   # TP solution key -> its search (settled when kept)
        self._settled: set[tuple] = set()         # TP solution keys whose pick has run sound
        self.cp_choices: dict[tuple, Any] = {}    # unit-cost key -> the priced CPChoice
        self.simulations = 0
        self.tp_skipped: dict[int, str] = {}     # tensor-parallel degree -> why its TP search refused
        self.mode_skipped: set[str] = set()      # why a constrained dp mode left a mesh unsearched
        self.pipeline_refusal, self._pipeline_units = pipeline_layout(self.model)
        if self.pipeline_refusal and int(self.cons.get("pp", 1)) > 1:
            raise InfeasiblePlanError(f"plan_cluster: constraints pp={self.cons['pp']}: {self.pipeline_refusal}")
        self.unit_names = self._unit_names()

    # ---------------------------------------------------------------- pricing
    @functools.cached_property
    def meta(self) -> torch.nn.Module:
        """The model on meta in the search's dtype, made once: every capture (one per micro-batch
        size) and every prober (one per tensor-parallel degree) reads it instead of copying the
        whole model again."""
        return meta_model(self.model, self.dtype)

    def graph(self, b: int, cp: int = 1):
        """The graph of one rank's micro-batch: ``b`` sequences of seq/cp tokens."""
        key = b if cp == 1 else (b, cp)
        if key not in self.graphs:
            self.graphs[key] = capture(self.meta, None, batch=(b, self.seq // cp), dtype=self.dtype)
        return self.graphs[key]

    def cp_shape(self, ctx, cp: int, b: int, tp: int, dtype_bytes: int) -> CPShape:
        """A candidate's context-parallel share: ``b`` sequences per micro-batch on the cp dimension,
        the loss reduced where its gradients are."""
        return CPShape(cp=cp, cp_dim="cp", loss_dim=ctx.dp_dim, local_batch=b, seq_len=self.seq,
                       dtype_bytes=dtype_bytes, tp=tp)

    @classmethod
    def of(cls, model: torch.nn.Module, devices: int, *, graphs: dict | None = None, **keywords: Any) -> "ClusterSearch":
        """A search from keywords, for callers that drive the search directly (benchmarks, tests):
        ``PlanRequest``'s fields (``hardware``, ``batch``, ``constraints`` ...), the search space's
        (``schedules``, ``microbatch_sizes``, ``virtual_stages``) and this class's own
        (``dp_modes``, ``recompute_modes``, ``expert_runtime``, ``loss_bytes_per_logit``). Not
        checked as a public entry point's are: ``plan_cluster`` is the checked door."""
        own = {k: keywords.pop(k) for k in ("dp_modes", "recompute_modes", "expert_runtime", "loss_bytes_per_logit")
               if k in keywords}
        space = {k: keywords.pop(k) for k in ("schedules", "microbatch_sizes", "virtual_stages") if k in keywords}
        request = PlanRequest(search=SearchSpace(**space), **keywords)
        return cls(model, devices, request, graphs=graphs, **own)

    def structure(self, b: int, cp: int = 1):
        if (b, cp) not in self._structures:
            self._structures[(b, cp)] = cp_structure(model_structure(self.graph(b, cp), self.loss_bytes_per_logit,
                                                                         self.compile), cp)
        return self._structures[(b, cp)]

    @functools.cached_property
    def moe_groups(self) -> list:
        """The model's MoE layers ExpertParallel can take (empty for a dense model)."""
        b = self.mb_sizes[0]
        return model_moe_groups(self.meta, self.graph(b), self.structure(b).dtype_bytes)

    def moe_groups_at(self, b: int, cp: int = 1) -> list:
        """The MoE groups of the graph of micro-batch ``b`` (and ``cp``): their captured work is what
        the TP search counted for that micro-batch, which the expert repricing replaces."""
        key = (b, cp)
        if key not in self._moe_groups:
            self._moe_groups[key] = model_moe_groups(self.meta, self.graph(b, cp), self.structure(b, cp).dtype_bytes)
        return self._moe_groups[key]

    def _unit_names(self) -> list[str]:
        """Pipeline units in execution order: the runtime split's cut points (``pipeline_units``)
        when it can cut the model, else (a model priced at pp=1 only) embedding, every block,
        final norms, head from the captured structure."""
        if self.pipeline_refusal is None:
            return list(self._pipeline_units)
        st = self.structure(self.mb_sizes[0])
        names = [st.embedding.fqn] if st.embedding else []
        for g in st.blocks:
            names += [f"{g.prefix}.{i}" for i in g.indices]
        return names + list(st.final_norms) + ([st.head.fqn] if st.head else [])

    def spec(self, dp: int, pp: int, tp: int, cp: int = 1, ep: int = 1) -> ParallelDims:
        return cluster_spec(dp, pp, tp, cp, ep, self.hardware, self.dpn)

    def ctx(self, dp: int, pp: int, tp: int, fsdp, ac, cp: int = 1, ep: int = 1):
        key = (dp, pp, tp, dp_mode_of(fsdp), recompute_of(ac), cp, ep)
        if key not in self._ctx:
            self._ctx[key] = self._make_ctx(*key)
        return self._ctx[key]

    def _make_ctx(self, dp: int, pp: int, tp: int, mode: str, recompute: str, cp: int = 1, ep: int = 1):
        """Costs on the candidate's mesh. Under cp, gradients and FSDP run on the flattened
        dp x cp mesh (``dp_cp``, priced as one dimension, ``context.cost.cp_topology``)."""
        spec = self.spec(dp, pp, tp, cp, ep)
        pbytes = self.structure(self.mb_sizes[0]).dtype_bytes
        topo, red_dim, red = mesh_topology(spec), "dp", dp
        if cp > 1:
            topo, red_dim, red = cp_topology(spec), flat_name(grad_dims(spec)), dp * cp
        mode = mode if red > 1 else "replicate"
        return CostContext(hardware=self.hw, topology=topo, dtype=str(self.dtype), tp_dim="tp",
                           dp_dim=red_dim, dp=red, fsdp=mode == "fsdp", param_bytes_per_element=pbytes,
                           optimizer_bytes_per_element=8 + (4 if pbytes < 4 else 0), dp_mode=mode,
                           recompute=recompute, async_tp=self.request.overlap == "async_tp",
                           float8=FLOAT8_PRICING[self.request.precision], compiled=self.compile != "none")

    def prober(self, tp: int, b: int, cp: int = 1):
        """One strategy prober per tensor-parallel degree: its verdicts hold for every
        micro-batch size and checkpointing choice (see autoplan/search/tp/soundness.py)."""
        if tp <= 1:
            return None
        if tp not in self._probers:
            graph = self.graph(b, cp)
            sibling = next((p for p in self._probers.values() if p is not None and p.reference is not None), None)
            self._probers[tp] = Prober(self.meta, graph.blocks, tp, (1, self.seq // cp), self.dtype, sibling=sibling) \
                if graph.blocks else None
        return self._probers[tp]

    def tp_solution(self, tp: int, b: int, ac, cp: int = 1, ep: int = 1):
        """The TP ILP's options for tensor-parallel degree ``tp`` at micro-batch ``b`` of seq/cp
        tokens, with ep's degree deciding whether experts are TP units (experts_tp; cached)."""
        key = _sol_key(tp, b, ac, cp, ep)
        ac = key[2]
        if key not in self._tp:
            ctx = self.ctx(1, 1, tp, False, ac)
            try:
                search = TPSearch(self.structure(b, cp), self.graph(b, cp), ctx, tp,
                                  allow_replicated=self.allow_replicated, sequence_parallel=self.sp,
                                  prober=self.prober(tp, b, cp), experts_tp=experts_tp(tp, cp, ep),
                                  experts_by_ep=ep > 1 and self.expert_parallel is not False)
            except InfeasiblePlanError as e:  # e.g. allow_replicated_units=False at a degree that cannot shard
                log.info("plan_cluster: tp=%d skipped: %s", tp, e)
                self.tp_skipped[tp] = str(e)
                self._tp[key] = None
                return None
            try:
                chosen, layout, info = search.solve(None, check=False)   # run only if kept: see settle()
            except InfeasiblePlanError as e:
                log.info("plan_cluster: tp=%d skipped: %s", tp, e)
                self.tp_skipped[tp] = str(e)
                self._tp[key] = None
                return None
            self._searches[key] = search
            self.tp_solver[key] = info
            self._chosen[key] = chosen
            if not chosen:
                self._tp[key] = None
            else:
                ev = search.evaluate(chosen, layout)
                self._tp[key] = (ev.options, layout)
        return self._tp[key]

    def settle(self, tp: int, b: int, ac, cp: int = 1, ep: int = 1) -> bool:
        """Run the TP pick of (tp, b, ac, cp) on the model (soundness.settle) if no run has yet;
        True when the run changed it. Picks are priced before they run: comparing degrees needs
        prices of all of them, keeping one needs only its run. When a run rejects or repairs an
        option, every price at this degree is dropped (the verdicts, shared per degree, change
        the other picks' options too) and the caller searches again."""
        key = _sol_key(tp, b, ac, cp, ep)
        if key in self._settled or self.tp_solution(tp, b, ac, cp, ep) is None:
            return False
        if not self._searches[key].run_pick(self._chosen[key], self._tp[key][1]):
            self._settled.add(key)
            return False
        log.info("plan_cluster: the run of tp=%d's pick changed it; prices at tp=%d computed again", tp, tp)
        for k in [k for k in self._tp if k[0] == tp]:
            for cache in (self._tp, self._searches, self._chosen, self.tp_solver):
                cache.pop(k, None)
            self._settled.discard(k)
        for k in [k for k in self._units if k[2] == tp]:
            del self._units[k]
        return True

    def tp_styles(self, tp: int, b: int, ac, cp: int = 1, ep: int = 1) -> tuple[dict, object]:
        """(pattern -> style, solver info) of the TP solution ``tp_solution`` priced: what the
        plan must apply, so its predicted rows and its styles are the same options."""
        options, _ = self.tp_solution(tp, b, ac, cp, ep)
        styles = {}
        for o in sorted(options, key=lambda o: o.slot):
            styles.update(o.styles())
        return styles, self.tp_solver[_sol_key(tp, b, ac, cp, ep)]

    def unit_costs(self, dp: int, pp: int, tp: int, fsdp, ac, b: int, cp: int = 1, ep: int = 1):
        """(per-unit costs, P2P seconds per micro-batch hop) of the TP solution on this mesh.

        Every cost comes from the one CostContext: compute per op class (recomputation included),
        TP collectives with their latency, dp traffic with FSDP's per-call latency charged once
        per wrapped unit (each block, and the root on the embedding's unit) exactly as
        ``TPSearch.evaluate`` charges it, and each unit's share of the optimizer step."""
        fsdp, ac = dp_mode_of(fsdp), recompute_of(ac)
        key = (dp, pp, tp, fsdp, ac, b, cp, ep)
        if key in self._units:
            return self._units[key]
        sol = self.tp_solution(tp, b, ac, cp, ep)
        if sol is None:
            self._units[key] = None
            return None
        options, layout = sol
        if fsdp == "fsdp" and dp > 1 and any(o.strategy.extra.get(PACKED_BIAS) for o in options):
            self._units[key] = None  # FSDP mixed precision and a packed bias: see strategies.PACKED_BIAS
            return None
        ctx = self.ctx(dp, pp, tp, fsdp, ac, cp, ep)
        names = self.unit_names
        index = {n: i for i, n in enumerate(names)}
        acc = [[0.0] * 8 for _ in names]  # F, I, W, state, act, dp_comm, one dp all-gather, optimizer
        st = self.structure(b, cp)
        all_targets, by_targets = [], {}
        members = block_members(st)
        head_i = index.get(st.head.fqn, len(names) - 1) if st.head else len(names) - 1
        emb_i = index.get(st.embedding.fqn, 0) if st.embedding else 0
        norm_i = index.get(st.final_norms[0], head_i) if st.final_norms else head_i
        for o in options:
            where = (o.slot, o.owner, o.in_block, cp)   # the same for every mesh and micro-batch size
            if where not in self._target_cache:
                self._target_cache[where] = option_units(o, names, index, emb_i, norm_i, head_i, members)
            targets = self._target_cache[where]
            all_targets.append(targets)
            if not targets:
                continue
            share = 1.0 / len(targets)   # options spanning the same units are summed, then spread once
            summed = by_targets.setdefault(tuple(targets), [0.0] * 8)
            for k, v in enumerate(o.unit_values(ctx)):
                summed[k] += v * share
        for targets, summed in by_targets.items():
            for t in targets:
                row = acc[t]
                for k in range(8):
                    row[k] += summed[k]
        if ctx.fsdp:  # per-call latency: one set of FSDP collectives per wrapped unit
            unit_lat = ctx.fsdp_latency_time(1)
            gather_lat = ctx.fsdp_latency_time(1) / 3.0   # one all-gather of the three calls
            blocks = {i for o, targets in zip(options, all_targets) if o.in_block for i in targets}
            for i in blocks:
                acc[i][5] += unit_lat
                acc[i][6] += gather_lat
            acc[emb_i][5] += unit_lat   # the root unit (embedding, norm, head)
        if cp > 1:
            tp_key = _sol_key(tp, b, ac, cp, ep)
            used = (sum(a[3] for a in acc) + sum(a[4] for a in acc)) / pp
            self.cp_choices[key] = add_cp(acc, names, st, self.graph(b, cp), ctx, self._chosen[tp_key],
                                          self.cp_shape(ctx, cp, b, tp, st.dtype_bytes), memory_left=self.limit - used)
        if ep == 1 and self.moe_groups:
            groups = self.moe_groups_at(b, cp)
            add_expert_compute(acc, names, groups, ctx, tokens=b * self.seq // cp, dtype_bytes=st.dtype_bytes,
                               etp=experts_split(options, st.blocks, groups, tp), runtime=self.expert_runtime)
        unit_fsdp = ctx.fsdp
        if ep > 1:
            experts = ExpertPlanning(self.meta, self.graph(b), st, ctx, self.spec(dp, pp, tp, cp, ep),
                                     groups=self.moe_groups_at(b), expert_parallel=self.expert_parallel,
                                     runtime=self.expert_runtime)
            unit_fsdp = add_ep(acc, names, options, all_targets, experts, dp_mode=fsdp)
            if not self.expert_runtime.fused_saves:
                # what ExpertParallel's forward saves, which replaces the captured expert forward
                restate_our_experts(acc, names, experts, ctx, self.meta, tokens=b * self.seq, dtype=self.dtype)
        # what a runtime with fused kernels saves instead of the captured modules (memory only)
        if self.expert_runtime.fused_saves:
            restate_activations(acc, names, st, self.moe_groups_at(b, cp) if self.moe_groups else [], ctx,
                                self.expert_runtime, tokens=b * self.seq // cp,
                                rows={r["fqn"]: r for r in module_summary(self.graph(b, cp)).to_dict("records")})
        if pp > 1:
            add_tied_copy(acc, options, st, ctx, emb_i, head_i)
        units = [UnitCost(n, *a, fsdp=unit_fsdp) for n, a in zip(names, acc)]
        hidden = st.hidden_bytes
        # what crosses a boundary: the hidden state (sequence-sharded on the S stream) and the values
        # a decoder's forward carries behind it (Qwen3-VL's DeepStack levels, whole on every rank)
        p2p_bytes = hidden / (tp if layout == "S" else 1) + (self.carried_bytes(b) if pp > 1 else 0)
        p2p = ctx.topology.collective_time("pp", "send_recv", p2p_bytes) if pp > 1 else 0.0
        self._units[key] = (units, p2p)
        return self._units[key]

    def carried_bytes(self, b: int) -> int:
        """Bytes a pipeline boundary carries behind the hidden state per micro-batch of ``b`` rows
        (``tower_plan.carried_sizes``; 0 for a model that carries nothing), once per size."""
        if b not in self._carried:
            self._carried[b] = sum(carried_sizes(self.meta, b, self.seq, self.dtype)[0])
        return self._carried[b]

    def cp_rows(self, cand) -> tuple[dict[str, list[Collective]], str]:
        """(block group id -> the cp exchange of one layer per micro-batch, the gradient / loss
        dimension) of candidate ``cand`` with cp > 1: what ``plan_cluster`` writes per pipeline rank."""
        key = (cand.dp, cand.pp, cand.tp, cand.dp_mode, cand.recompute, cand.b, cand.cp, cand.ep)
        self.unit_costs(*key)
        ctx = self.ctx(cand.dp, cand.pp, cand.tp, cand.dp_mode, cand.recompute, cand.cp, cand.ep)
        st = self.structure(cand.b, cand.cp)
        chosen = self._chosen[_sol_key(cand.tp, cand.b, cand.recompute, cand.cp, cand.ep)]
        rows = cp_layer_rows(st, self.graph(cand.b, cand.cp), ctx, chosen, self.cp_choices[key].variant,
                             self.cp_shape(ctx, cand.cp, cand.b, cand.tp, st.dtype_bytes))
        return rows, ctx.dp_dim

    # ---------------------------------------------------------------- search
    def modes(self, dp: int, fsdp_only: bool = False) -> list[tuple[str, str]]:
        """(dp mode, recompute) pairs to search; constraints ``dp_mode`` / ``recompute`` (or the
        older bools ``fsdp`` / ``activation_checkpointing``) fix them. ``fsdp_only``: plans with
        cp run FSDP over dp x cp (the mode their plans apply); ``dp``: the ranks state can be
        sharded over (with ep its ranks too: FSDP and ZeRO-1 shard the non-expert state over dp x ep)."""
        if "dp_mode" in self.cons:
            fs = [dp_mode_of(self.cons["dp_mode"])]
        elif "fsdp" in self.cons:
            fs = [dp_mode_of(bool(self.cons["fsdp"]))]
        else:
            fs = list(self.dp_modes) if dp > 1 else ["fsdp"]
        if fsdp_only:
            kept = [f for f in fs if f == "fsdp"] if dp > 1 else ["fsdp"]   # one dp rank: no mode to pick
            if not kept:
                self.mode_skipped.add(f"dp_mode={fs[0]!r} with cp: those meshes run FSDP over their "
                                      f"data-parallel ranks (the mode the runtime applies them with); ask "
                                      f"dp_mode='fsdp' or leave the mode to the planner")
            fs = kept
        if "recompute" in self.cons:
            acs = [recompute_of(self.cons["recompute"])]
        elif "activation_checkpointing" in self.cons:
            acs = [recompute_of(bool(self.cons["activation_checkpointing"]))]
        else:
            acs = list(self.recompute_modes)
        return [(f, a) for f in fs for a in acs]

    def microbatch_options(self, dp: int) -> list[tuple[int, int]]:
        """(micro-batch size b, micro-batches m) with dp * m * b = global batch."""
        if self.gb % dp:
            return []
        local = self.gb // dp
        out = [(b, local // b) for b in self.mb_sizes if local % b == 0]
        if "microbatches" in self.cons:
            out = [(b, m) for b, m in out if m == self.cons["microbatches"]]
        return out

    def exposed(self, mode: str = "fsdp"):
        """The exposed-dp function for ``mode`` (cost_models.overlap)."""
        mode = dp_mode_of(mode)
        return lambda comm, compute: exposed_dp(comm, compute, mode)

    def meshes(self) -> list[tuple[int, int, int, int, int]]:
        """(dp, pp, tp, cp, ep) to search: dp x pp x tp factorizations of the devices each cp or
        ep degree leaves (``cluster_dims``: which degrees, cp after dp, ep borrowed from dp, with
        or without a pipeline; cp with a pipeline where the runtime runs it)."""
        n_units = len(self.unit_names)
        rest = {k: v for k, v in self.cons.items() if k not in ("cp", "ep")}
        out = []
        cps = cp_degrees(self.meta, self.seq, self.devices, self.cons)
        eps = ep_degrees(self.moe_groups, self.devices, self.cons) if max(cps) == 1 else [1]
        for cp in cps:
            for ep in eps:
                if cp > 1 and ep > 1 or self.devices % (cp * ep):
                    continue
                max_pp = n_units if self.pipeline_refusal is None else 1
                for dp, pp, tp in mesh_factorizations(self.devices // (cp * ep), self.dpn, max_pp, rest):
                    if cp > 1 and pp > 1 and not CP_WITH_PP:
                        continue
                    out.append((dp, pp, tp, cp, ep))
        return out

    def search(self, max_simulations: int = 400, time_budget_s: float | None = None) -> list[Candidate]:
        """All candidates that were simulated, best first (the first is the optimum: the rest of
        the space was cut by lower bounds, unless the budget ran out, which is logged). The best
        one's TP pick has run sound on the model (:meth:`settle`); when that run changes the
        pick, the degree is priced again and the search repeated (cached prices make it cheap)."""
        while True:
            done = self._search_once(max_simulations, time_budget_s)
            best = done[0]
            if not self.settle(best.tp, best.b, best.recompute, best.cp, best.ep):
                return done

    def _search_once(self, max_simulations: int, time_budget_s: float | None) -> list[Candidate]:
        t0 = time.perf_counter()
        meshes = self.meshes()
        if not meshes:
            raise InfeasiblePlanError(f"plan_cluster: no dp x pp x tp factorization of {self.devices} devices "
                                      f"({self.dpn} per node) meets constraints {self.cons}")

        def least_bubble(p: int, m: int) -> float:   # of the searched schedules, uniform stages
            return min(schedule_facts(n).bubble_fraction(p, m, v) for n in self.schedules for v in self.virtual)

        groups = []  # (estimate, lower bound, dp, pp, tp, fsdp, ac, b, m, cp, ep)
        for dp, pp, tp, cp, ep in meshes:
            for b, m in self.microbatch_options(dp * ep):
                if cp > 1 and b > 1:
                    continue   # with cp a micro-batch is one sequence (cluster_dims)
                for fsdp, ac in self.modes(dp * cp * ep, fsdp_only=cp > 1):
                    uc = self.unit_costs(dp, pp, tp, fsdp, ac, b, cp, ep)
                    if uc is None:
                        continue
                    units, _ = uc
                    total_t = sum(u.time for u in units)
                    if sum(u.state_bytes for u in units) / pp > self.limit:
                        continue
                    # exposed dp time is convex in (traffic, compute), so its max over ranks is at
                    # least its value at the rank average (Jensen): a valid bound before any cut
                    # (one stage: FSDP traffic repeats per micro-batch of gradient accumulation, exactly)
                    dp_min = exposed_dp(sum(u.dp_comm_s * (m if pp == 1 and u.fsdp else 1) for u in units) / pp,
                                        m * total_t / pp, fsdp) \
                        + sum(u.optimizer_s for u in units) / pp
                    chain = sum(u.forward + u.backward_input for u in units)
                    lb = max(m * total_t / pp, chain) + dp_min
                    # visiting order only: the least bubble any schedule has on even stages
                    est = m * total_t / pp * (1 + least_bubble(pp, m)) + dp_min
                    groups.append((est, lb, dp, pp, tp, fsdp, ac, b, m, cp, ep))
        # one-stage groups first: timed in closed form (no schedule IR), they give the bound that
        # lets pipelined groups be skipped before their schedules are generated
        groups.sort(key=lambda g: (g[3] > 1, g))
        best, done, cut = float("inf"), [], False
        for _est, lb, dp, pp, tp, fsdp, ac, b, m, cp, ep in groups:
            if lb >= best:
                continue
            if len(done) >= max_simulations or (time_budget_s and time.perf_counter() - t0 > time_budget_s):
                cut = True
                break
            units, p2p = self.unit_costs(dp, pp, tp, fsdp, ac, b, cp, ep)
            # split-backward schedules run a stage's weight gradients in a second backward pass; torch's
            # selective checkpointing allows one backward per region, so selective is not paired with them
            scheds = [n for n in self.schedules
                      if not (recompute_of(ac) == "selective" and schedule_facts(n).split_backward)]
            cands = pipeline_candidates(units, pp, [m], self.limit, scheds, self.virtual, bound=best,
                                        extra=lb - max(m * sum(u.time for u in units) / pp,
                                                       sum(u.forward + u.backward_input for u in units)))
            if "cuts" in self.cons:   # the cuts a framework makes (Megatron-Core's, AutoModel's: even)
                even = self.cons["cuts"] == "even"
                cands = [c for c in cands if (c.starts == even_starts(len(units), c.p * c.v)) == even]
            cands.sort(key=lambda c: (estimate(c, units, p2p), c.schedule, c.starts))
            exposed = self.exposed(fsdp if dp * cp * ep > 1 else "fsdp")
            for c in cands:
                if full_lower_bound(c, units, exposed) >= best:
                    continue
                time_choice(c, units, p2p, exposed)
                self.simulations += 1
                if max(c.rank_memory) > self.limit:
                    continue
                done.append(Candidate(dp, pp, tp, fsdp, ac, b, c, cp, ep))
                best = min(best, c.step_s)
        if cut:
            log.warning("plan_cluster: stopped after %d simulations / %.1f s; the best is not proven optimal",
                        self.simulations, time.perf_counter() - t0)
        if not done:
            why = (f"no plan simulated within the budget ({self.simulations} simulations, "
                   f"{time.perf_counter() - t0:.0f} s) fits" if cut else
                   "no mesh left to search within" if self.mode_skipped and not self.simulations else "nothing fits")
            skipped = "".join(f"; tp={t} refused: {reason}" for t, reason in sorted(self.tp_skipped.items()))
            skipped += "".join(f"; {reason}" for reason in sorted(self.mode_skipped))
            raise InfeasiblePlanError(
                f"plan_cluster: {why} {self.limit / 2**30:.1f} GiB per device on {self.devices} devices "
                f"(global batch {self.gb}, seq {self.seq}, constraints {self.cons}){skipped}")
        done.sort(key=lambda c: c.key)
        log.info("plan_cluster: %d meshes, %d groups, %d simulations, %.2f s", len(meshes), len(groups),
                 self.simulations, time.perf_counter() - t0)
        return done

    # one fixed layout priced with the same costs (autoplan/search/mesh/fixed.py)
    evaluate = evaluate_layout
