"""The tensor-parallel style search: candidates per unit, exact evaluation, and the ILP.

Units are the attention, MLP and norms of each distinct repeated block (solved once, costed
times the block count), the embedding, the final norm and the LM head. The residual stream
between them is one layout for the whole model, R or S (sequence parallel), as in every expert
plan; it is a one-hot pair of ILP variables that each unit's choice must agree with. The
embedding's output layout and the stream are joined by an edge with one continuous variable
per (embedding choice, stream layout) pair -- the linearisation that keeps the ILP small and
tight. The same per-option numbers feed :meth:`TPSearch.evaluate`, which prices any assignment
(the solver's, a hand-written one, an alternative), so predictions and objective agree.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import pulp
from hyper_parallel.core.collective import Collective

from autoplan.capture.ir import ModelGraph
from autoplan.errors import InfeasiblePlanError
from autoplan.search.pricing.async_tp import async_tp_exposed
from autoplan.search.pricing.costing import CostContext
from autoplan.search.tp.strategies import (
    Strategy,
    attention_strategies,
    embedding_strategies,
    head_strategies,
    mlp_strategies,
    norm_strategies,
)
from autoplan.search.tp.stream_entry import stream_entry
from autoplan.search.tp.mamba_strategies import mamba_strategies
from autoplan.search.tp.expert_strategies import experts_strategies, within_container
from autoplan.search.tp.moa_strategies import moa_strategies
from autoplan.search.tp.probe import Prober
from autoplan.search.tp.group_patterns import wildcard_group
from autoplan.search.tp.soundness import SoundnessReport, check_search, settle
from autoplan.search.tp.ilp import ilp_solver
from autoplan.search.units.mixers import MOE_NOT_A_TP_UNIT, without_moe_units
from autoplan.search.units.structure import ModelStructure
from autoplan.search.units.work import Work
from cost_models.overlap import dp_overlap

log = logging.getLogger(__name__)
TIE_EPS = 1e-9  # seconds per option rank: deterministic preference for simpler options on ties
# How much data-parallel traffic compute hides is stated per dp mode in cost_models.overlap.


@dataclass
class Option:
    slot: str
    strategy: Strategy
    owner: str                      # "" (model root) or block pattern(s) like "layers.*", comma-joined
    count: int
    work: Work
    param_bytes: float
    rank: int
    fsdp_unit: bool = False

    @property
    def stream(self) -> str | None:
        return self.strategy.stream

    def collectives(self, ctx: CostContext) -> list[Collective]:
        own = [c.scaled(self.count) for c in self.strategy.collectives]
        if ctx.checkpoint_blocks and self.in_block:  # recomputed forward repeats its collectives
            own += [Collective(c.kind, "backward", c.nbytes, c.count * self.count, c.dim)
                    for c in self.strategy.collectives if c.phase == "forward" and not self._not_recomputed(c)]
        gathered8 = ctx.float8_gathered(self.work, self.strategy.compute_shard, self.strategy.split_tokens)
        dp = ctx.fsdp_collectives(self.param_bytes, self.strategy.param_shard, gathered8) + \
            ctx.ddp_collectives(self.param_bytes, self.strategy.param_shard)
        return own + [c.scaled(self.count) for c in dp]

    @property
    def in_block(self) -> bool:
        return bool(self.owner)

    def _not_recomputed(self, c: Collective) -> bool:
        """torch's non-reentrant checkpoint stops recomputing once every saved tensor is back;
        the MLP's output reduction produces nothing saved (it only feeds the residual add), so
        it is the one forward collective of a block that is not repeated."""
        return self.slot.endswith("/mlp") and c.kind in ("reduce_scatter", "all_reduce")

    def compute_s(self, ctx: CostContext) -> float:
        st = self.strategy
        t = ctx.compute_time(self.work, st.compute_shard, st.split_tokens)
        if self.in_block:  # forward (full) or attention core (selective) recomputed in backward
            t += ctx.recompute_time(self.work, st.compute_shard, st.split_tokens)
        return self.count * t

    def optimizer_s(self, ctx: CostContext) -> float:
        """This option's share of the AdamW step (its parameters after TP, FSDP and ZeRO-1)."""
        if self.param_bytes <= 0:
            return 0.0
        return self.count * ctx.optimizer_time(0, ctx.optimizer_elements(self.param_bytes, self.strategy.param_shard),
                                               ctx.dp_mode != "replicate")

    def comm_s(self, ctx: CostContext) -> float:
        return ctx.comm_time(self.collectives(ctx))

    def tp_comm_s(self, ctx: CostContext) -> float:
        """Communication on the critical path (tensor-parallel collectives)."""
        return sum(self.tp_exposed(ctx))

    def tp_exposed(self, ctx: CostContext) -> tuple[float, float]:
        """(forward, backward) seconds of this option's tensor-parallel collectives that no compute
        hides: all of them, except under async TP on a sequence-sharded stream, where each is fused
        with the matmuls beside it (``pricing.async_tp``)."""
        if not (ctx.async_tp and self.stream == "S" and self.work.gemms):
            coll = [c for c in self.collectives(ctx) if c.dim == "tp"]
            return (ctx.comm_time([c for c in coll if c.phase == "forward"]),
                    ctx.comm_time([c for c in coll if c.phase != "forward"]))
        own = [c.scaled(self.count) for c in self.strategy.collectives if c.dim == "tp"]
        redo = [c.scaled(self.count) for c in self.strategy.collectives
                if c.dim == "tp" and c.phase == "forward" and not self._not_recomputed(c)] \
            if ctx.checkpoint_blocks and self.in_block else []
        return async_tp_exposed(ctx, self.work.gemms, self.strategy.compute_shard, own, redo)

    def dp_comm_s(self, ctx: CostContext) -> float:
        """Data-parallel (FSDP/DDP) communication, which overlaps with compute. Under FSDP only
        the bandwidth term: the per-call latency is paid once per FSDP unit (block), not per
        planner unit, and is added once in :meth:`TPSearch.fsdp_latency`."""
        return ctx.comm_time([c for c in self.collectives(ctx) if c.dim != "tp"], latency=not ctx.fsdp)

    def memory(self, ctx: CostContext) -> dict[str, float]:
        st = ctx.state_bytes(self.param_bytes, self.strategy.param_shard)
        if ctx.checkpoint_blocks and self.in_block:
            # only each block's input survives the forward (sharded when the stream is S)
            keep = self.strategy.extra.get("block_input_bytes", 0.0) if self.slot.endswith("/other") else 0.0
            st["activations"] = keep / (ctx_tp(ctx) if self.stream == "S" else 1)
        else:
            saved = self.work.saved
            if ctx.recompute == "selective" and self.in_block and self.work.core is not None:
                saved = max(saved - self.work.core.saved, 0.0)  # the attention core is recomputed
            st["activations"] = saved / self.strategy.activation_shard
        return {k: v * self.count for k, v in st.items()}

    def unit_values(self, ctx: CostContext) -> tuple[float, ...]:
        """(forward, backward-input, backward-weight seconds, state bytes, activation bytes, dp
        seconds, one dp all-gather, optimizer seconds) over all instances of this option: the
        fields of a pipeline UnitCost before they are shared among the units the option spans
        (autoplan.search.mesh.search; a VL model's tower blocks in autoplan.search.pipeline.tower_plan)."""
        st = self.strategy
        once = ctx.compute_time(self.work, st.compute_shard, st.split_tokens)
        extra = ctx.recompute_time(self.work, st.compute_shard, st.split_tokens) if self.in_block else 0.0
        base = self.count * once     # forward + backward without the recomputation (which runs in backward)
        c = base + self.count * extra
        coll = self.collectives(ctx)
        f_comm, b_comm = self.tp_exposed(ctx)
        dp_comm = ctx.comm_time([x for x in coll if x.dim != "tp"], latency=not ctx.fsdp)   # as dp_comm_s
        mem = self.memory(ctx)
        gather = ctx.comm_time([x for x in coll if x.dim == "dp" and x.kind == "all_gather"
                                and x.phase == "forward"], latency=False) if (ctx.fsdp and self.in_block) else 0.0
        return (base / 3 + f_comm, c - 2 * base / 3 + b_comm, base / 3,
                sum(v for k, v in mem.items() if k != "activations"), mem.get("activations", 0.0),
                dp_comm, gather, self.optimizer_s(ctx))

    def styles(self) -> dict[str, object]:
        """Styles with full patterns (owner prefix joined; one pattern per owner)."""
        if not self.owner:
            return dict(self.strategy.styles)
        return {f"{owner}.{k}": v for owner in self.owner.split(",") for k, v in self.strategy.styles.items()}


def exposed_dp(dp_comm: float, compute: float, mode: str = "fsdp") -> float:
    """Data-parallel seconds that compute cannot hide (cost_models.overlap, per dp mode)."""
    return dp_overlap(mode).exposed(dp_comm, compute)


def ctx_tp(ctx: CostContext) -> int:
    dim = ctx.tp_dim
    return ctx.topology[dim].size if dim in ctx.topology.names else 1


def _param_tensor_bytes(graph: ModelGraph, fqn: str, dtype_bytes: int) -> list[int]:
    out = []
    for m in graph.modules_under(fqn):
        for shape in m.params.values():
            n = 1
            for s in shape:
                n *= s
            out.append(n * dtype_bytes)
    return out


@dataclass
class Evaluation:
    step_s: float
    compute_s: float
    comm_s: float
    memory: dict[str, float]
    options: list[Option]
    collectives: list[Collective]

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())


@dataclass
class SolverInfo:
    solver: str
    status: str
    time_s: float
    variables: int
    constraints: int


@dataclass
class TPSearch:
    structure: ModelStructure
    graph: ModelGraph
    ctx: CostContext
    tp: int
    allow_replicated: bool = True
    sequence_parallel: bool | None = None
    slots: dict[str, list[Option]] = field(default_factory=dict)
    layouts: tuple[str, ...] = ("R",)
    prober: Prober | None = None         # checks candidates on the model (see soundness.py)
    soundness: SoundnessReport = field(default_factory=SoundnessReport)
    # MoE experts as a TP unit (False: an ep dimension plans them, or a cluster search that prices
    # one TP solution for every ep degree)
    experts_tp: bool = True
    # an ep dimension splits the experts (the expert plan, ExpertParallel): their layers are no TP
    # unit, yet sharded -- ``allow_replicated=False`` does not refuse them (the expert plan is then
    # held to ExpertParallel)
    experts_by_ep: bool = False

    def __post_init__(self) -> None:
        if not self.experts_tp:   # experts planned elsewhere (ep) or not priced: no unit, stream kept off them
            self.structure = without_moe_units(self.structure)
        st, t = self.structure, self.tp
        db = st.dtype_bytes
        seqs = [b.seq_len for b in st.blocks]
        can_s = t > 1 and bool(st.blocks) and all(s % t == 0 for s in seqs)
        self.layouts = ("R", "S") if can_s else ("R",)
        if self.sequence_parallel is True:
            if not can_s:
                raise InfeasiblePlanError(
                    f"sequence_parallel=True: needs tp > 1 and every block's sequence length {seqs} "
                    f"divisible by tp={t}")
            self.layouts = ("S",)
        elif self.sequence_parallel is False:
            self.layouts = ("R",)
        for b in st.blocks:
            owner = self._owner(b)
            rep = b.representative
            for layout in self.layouts:
                for name, unit in (("attention", b.attention), ("cross_attention", b.cross_attention)):
                    if unit is not None:
                        for s in (moa_strategies if unit.moa else attention_strategies)(unit, b, t, layout):
                            self._add(f"{b.id}/{name}", s, owner, b.count, unit.work, unit.work.param_bytes)
                if b.mlp is not None:
                    pt = _param_tensor_bytes(self.graph, f"{rep}.{b.mlp.rel}", db)
                    for s in within_container(mlp_strategies, b.mlp, b, t, layout, pt):
                        self._add(f"{b.id}/mlp", s, owner, b.count, b.mlp.work, b.mlp.work.param_bytes)
                if b.moe is not None:
                    for s in experts_strategies(b.moe, b, t, layout):
                        self._add(f"{b.id}/moe", s, owner, b.count, b.moe.work, b.moe.work.param_bytes)
                if b.mamba is not None:
                    for s in mamba_strategies(b.mamba, b, t, layout):
                        self._add(f"{b.id}/mamba", s, owner, b.count, b.mamba.work, b.mamba.work.param_bytes)
                pt = [x for n in b.norms for x in _param_tensor_bytes(self.graph, f"{rep}.{n}", db)]
                for s in norm_strategies(b.norms, t, layout, pt, b.norm_token_dims):
                    self._add(f"{b.id}/norms", s, owner, b.count, b.norm_work, b.norm_param_bytes)
                self._add(f"{b.id}/other", Strategy("replicate", layout, {}, [],
                                                    extra={"block_input_bytes": b.hidden_bytes}),
                          owner, b.count, b.other_work, b.other_work.param_bytes)
        hidden = st.hidden_bytes
        seq = seqs[0] if seqs else 1
        if st.embedding is not None:
            for s in embedding_strategies(st.embedding, t, seq, hidden):
                self._add("embedding", s, "", 1, st.embedding.work, st.embedding.work.param_bytes)
        for layout in self.layouts:
            pt = [x for n in st.final_norms for x in _param_tensor_bytes(self.graph, n, db)]
            for s in norm_strategies(st.final_norms, t, layout, pt):
                self._add("final_norm", s, "", 1, st.final_norm_work, st.final_norm_param_bytes)
            if st.head is not None:
                for s in head_strategies(st.head, t, layout, hidden):   # the stream entering the head
                    pb = 0 if st.head.tied else st.head.work.param_bytes
                    self._add("head", s, "", 1, st.head.work, pb)
        self._add("rest", Strategy("replicate", None, {}, []), "", 1, st.rest, st.rest.param_bytes)
        self.soundness = check_search(self, self.prober)
        self._check_sequence_parallel()
        self._require_sharded()

    def _check_sequence_parallel(self) -> None:
        if self.sequence_parallel is True and "S" not in self.layouts:
            raise InfeasiblePlanError(
                f"sequence_parallel=True: {'; '.join(self.soundness.notes())}")

    def _owner(self, b) -> str:
        """Pattern(s) naming the members of block group ``b``. The largest group under a prefix
        takes ``prefix.*``; smaller groups under the same prefix (T5's first block, Gemma-2's
        alternating layers) name their indices, which the most-specific-pattern rule lets win
        (where it cannot -- the small group leaves a module unstyled -- seal_group_wildcards
        names the large group's indices instead)."""
        join = (lambda i: f"{b.prefix}.{i}") if b.prefix else (lambda i: i)
        if b is wildcard_group(self.structure.blocks, b.prefix):
            return join("*")
        return ",".join(join(i) for i in b.indices)

    def _add(self, slot: str, s: Strategy, owner: str, count: int, work: Work, param_bytes: float) -> None:
        opts = self.slots.setdefault(slot, [])
        opts.append(Option(slot, s, owner, count, work, param_bytes, rank=len(opts)))

    def unit_module(self, slot: str) -> str:
        """The module (pattern) a slot plans: ``model.layers.*.self_attn`` for a block unit."""
        st = self.structure
        for b in st.blocks:
            if slot.startswith(b.id + "/"):
                unit = {"attention": b.attention, "cross_attention": b.cross_attention,
                        "mlp": b.mlp, "moe": b.moe, "mamba": b.mamba}.get(slot.split("/")[-1])
                owner = self._owner(b)
                return f"{owner}.{unit.rel}" if unit is not None and unit.rel else owner
        fixed = {"embedding": st.embedding.fqn if st.embedding else None, "head": st.head.fqn if st.head else None}
        return fixed.get(slot) or slot

    def _held_back(self, slot: str, o: Option) -> bool:
        """A strategy marked ``fallback_for`` another is not picked while that one is still a
        candidate: equal in cost, the two would otherwise tie. It stays in ``slots`` -- the probe
        runs it when the primary fails (OLMo-2's post-norm blocks need their stream norms'
        local-output form) -- and becomes pickable once the primary is rejected."""
        primary = o.strategy.extra.get("fallback_for")
        return primary is not None and any(x.strategy.name == primary and x.stream == o.stream
                                           for x in self.slots.get(slot, []))

    def _must_shard(self, slot: str) -> bool:
        """With ``allow_replicated=False`` the ILP may not pick a replicated attention, MLP,
        experts, mixer, embedding or head (the options stay: the probe's base assignment runs them)."""
        return not self.allow_replicated and (slot.endswith(("/attention", "/cross_attention", "/mlp", "/mamba",
                                                             "/moe"))
                                              or slot in ("embedding", "head"))

    def _require_sharded(self) -> None:
        """Raise when ``allow_replicated=False`` leaves a unit without any sharded candidate."""
        if self.allow_replicated:
            return
        left = [(w, why) for w, why in self.structure.not_units
                if not (self.experts_by_ep and why == MOE_NOT_A_TP_UNIT)]
        if left:
            where, why = left[0]
            raise InfeasiblePlanError(f"{where}: cannot be tensor-parallel at tp={self.tp}: {why}; "
                                      f"allow replicated units")
        # a whole model part (a stack, a tower: a tenth of the parameters or more) left out is
        # refused; glue such as a projector between tower and decoder is a note only
        large = [(w, n) for w, n in self.structure.outside_units if n >= 0.1 * self.structure.num_parameters]
        if large:
            where, n = large[0]
            raise InfeasiblePlanError(
                f"{where}: {n:,} parameters in linear layers that no unit plans (outside every repeated "
                f"block group, embedding and head), so they would stay replicated at tp={self.tp}; "
                f"allow replicated units")
        for slot in self.slots:
            if self._must_shard(slot) and all(o.strategy.name == "replicate" for o in self.slots[slot]):
                why = next((o.strategy.extra.get("tp_excluded") for o in self.slots[slot]
                            if o.strategy.extra.get("tp_excluded")), "no sharded strategy applies")
                raise InfeasiblePlanError(
                    f"{self.unit_module(slot)}: cannot be tensor-parallel at tp={self.tp}: {why}; "
                    f"allow replicated units or choose another tp degree")

    def fsdp_latency(self) -> float:
        """Per-call cost of FSDP's collectives: one set per wrapped block plus the root, whatever
        the tensor-parallel choice (a constant of the ILP, but part of the predicted step)."""
        if not self.ctx.fsdp:
            return 0.0
        return self.ctx.fsdp_latency_time(sum(b.count for b in self.structure.blocks) + 1)

    # ------------------------------------------------------------------ entry edge
    def entry(self, emb: Option | None, layout: str) -> Strategy | None:
        if not self.structure.blocks:
            return Strategy("none", layout, {}, []) if emb is None or emb.stream == layout else None
        return stream_entry(self.structure.blocks, layout if emb is None else emb.stream, layout)

    # ------------------------------------------------------------------ evaluation
    def option_cost(self, o: Option) -> float:
        """Compute plus critical-path (TP) communication; DP communication is priced as the part
        that compute cannot hide (see ``solve``/``evaluate``)."""
        return o.compute_s(self.ctx) + o.tp_comm_s(self.ctx)

    def evaluate(self, chosen: dict[str, Option], layout: str) -> Evaluation:
        opts = list(chosen.values())
        entry = self.entry(chosen.get("embedding"), layout)
        if entry is None:
            raise InfeasiblePlanError(f"embedding output {chosen['embedding'].stream} cannot feed a {layout} stream")
        if entry.styles or entry.collectives:
            opts.append(Option("entry", entry, "", 1, Work(), 0, rank=0))
        compute = sum(o.compute_s(self.ctx) for o in opts)
        tp_comm = sum(o.tp_comm_s(self.ctx) for o in opts)
        dp_comm = sum(o.dp_comm_s(self.ctx) for o in opts) + self.fsdp_latency()
        comm = tp_comm + self.ctx.exposed_dp(dp_comm, compute)
        compute += sum(o.optimizer_s(self.ctx) for o in opts)
        memory: dict[str, float] = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        for o in opts:
            for k, v in o.memory(self.ctx).items():
                memory[k] += v
        colls = [c for o in opts for c in o.collectives(self.ctx)]
        return Evaluation(compute + comm, compute, comm, memory, opts, colls)

    def assignment(self, layout: str, prefer: dict[str, str]) -> dict[str, Option]:
        """The options named in ``prefer`` (slot suffix -> strategy name), else replicate."""
        chosen = {}
        for slot, opts in self.slots.items():
            key = slot.split("/")[-1]
            cands = [o for o in opts if o.stream in (None, layout) or slot == "embedding"]
            want = prefer.get(key, "replicate")
            pick = [o for o in cands if o.strategy.name == want] or [o for o in cands if o.strategy.name == "replicate"]
            if slot == "embedding":
                pick = sorted(pick, key=lambda o: (o.stream != layout, o.rank))
            if not pick:
                pick = sorted(cands, key=lambda o: o.rank)
            if not pick:
                raise InfeasiblePlanError(f"{self.unit_module(slot)}: no strategy for a {layout} stream")
            chosen[slot] = pick[0]
        return chosen

    def assignment_from_styles(self, styles: dict) -> tuple[dict[str, Option], str, list[str]]:
        """The options a hand-written plan amounts to: for each slot, the candidate whose styles
        all appear in ``styles`` (the largest such), for the stream layout that accounts for the
        most of ``styles``. Returns (chosen, layout, patterns no option accounts for).

        PrepareModuleInput entries that only annotate a replicated input are optional: plans
        written for torch often leave them out (DTensor then all-reduces each column-parallel
        linear's input gradient separately; the costing assumes the one shared annotation)."""
        wanted = {k: _canonical(v) for k, v in styles.items()}
        best = None
        for layout in self.layouts:
            chosen, covered = {}, set()
            for slot, opts in self.slots.items():
                cands = [o for o in opts if o.stream in (None, layout) or slot == "embedding"]
                fits = []
                for o in cands:
                    own = {k: _canonical(v.to_dict()) for k, v in o.styles().items()}
                    required = {k: v for k, v in own.items() if not _optional(v)}
                    if all(wanted.get(k) == v for k, v in required.items()) and \
                            all(wanted.get(k, v) == v for k, v in own.items()):
                        fits.append((len(required), -o.rank, o, own))
                if not fits:
                    chosen = None
                    break
                fits.sort(key=lambda f: (f[0], f[1]))
                _, _, o, own = fits[-1]
                chosen[slot] = o
                covered |= {k for k in own if k in wanted}
            if chosen is None:
                continue
            if self.entry(chosen.get("embedding"), layout) is None:
                continue
            entry = self.entry(chosen.get("embedding"), layout)
            covered |= {k for k in entry.styles if k in wanted}
            missing = sorted(set(wanted) - covered)
            if best is None or len(missing) < len(best[2]):
                best = (chosen, layout, missing)
        if best is None:
            raise InfeasiblePlanError("the given styles match no combination of the planner's strategies")
        return best

    # ------------------------------------------------------------------ ILP
    def solve(self, memory_limit: float | None = None, objective: str = "time",
              check: bool = True) -> tuple[dict[str, Option], str, SolverInfo]:
        """The cheapest assignment whose every option has run sound on the model (soundness.settle):
        solve, run the pick, and solve again whenever the run removed or repaired an option.
        ``check=False``: the pick as priced, not yet run (a caller comparing many degrees runs
        only the one it keeps, then solves again with ``check=True``)."""
        while True:
            chosen, layout, info = self._solve_once(memory_limit, objective)
            if not check or not chosen or objective != "time" or not settle(self, chosen, layout):
                return chosen, layout, info
            self._check_sequence_parallel()
            self._require_sharded()

    def run_pick(self, chosen: dict[str, Option], layout: str) -> bool:
        """Run a pick of ``solve(check=False)`` on the model; True when the run removed or
        repaired one of its options (its price is then stale: solve again)."""
        return settle(self, chosen, layout)

    def checked(self, chosen: dict[str, Option], layout: str) -> bool:
        """Run ``chosen`` (e.g. a hand-written plan's options) on the model when no run has judged
        it; False when that removed one of its options (the caller matches again)."""
        settle(self, chosen, layout)
        return all(any(o is x for x in self.slots.get(slot, [])) for slot, o in chosen.items())

    def _solve_once(self, memory_limit: float | None, objective: str) -> tuple[dict[str, Option], str, SolverInfo]:
        prob = pulp.LpProblem("tp_styles", pulp.LpMinimize)
        z = {L: pulp.LpVariable(f"stream_{L}", cat="Binary") for L in self.layouts}
        prob += pulp.lpSum(z.values()) == 1, "one_stream_layout"
        x: dict[tuple[str, int], pulp.LpVariable] = {}
        for slot, opts in self.slots.items():
            for o in opts:
                x[slot, o.rank] = pulp.LpVariable(f"x_{_safe(slot)}_{o.rank}", cat="Binary")
            if slot == "embedding" or all(o.stream is None for o in opts):
                prob += pulp.lpSum(x[slot, o.rank] for o in opts) == 1, f"one_{_safe(slot)}"
            else:
                for L in self.layouts:
                    prob += pulp.lpSum(x[slot, o.rank] for o in opts if o.stream == L) == z[L], f"agree_{_safe(slot)}_{L}"
        cost, mem = [], []
        for slot, opts in self.slots.items():
            for o in opts:
                if (self._must_shard(slot) and o.strategy.name == "replicate") or self._held_back(slot, o):
                    x[slot, o.rank].upBound = 0
            for o in opts:
                c = self.option_cost(o) if objective == "time" else 0.0
                cost.append((c + TIE_EPS * o.rank) * x[slot, o.rank])
                mem.append(sum(o.memory(self.ctx).values()) * x[slot, o.rank])
        y = {}
        for o in self.slots.get("embedding", []):  # edge: embedding output -> stream
            for L in self.layouts:
                e = self.entry(o, L)
                y[o.rank, L] = pulp.LpVariable(f"y_emb{o.rank}_{L}", lowBound=0, upBound=0 if e is None else 1)
                if e is not None:
                    cost.append(((self.ctx.comm_time(e.collectives) if objective == "time" else 0.0)) * y[o.rank, L])
            prob += pulp.lpSum(y[o.rank, L] for L in self.layouts) == x["embedding", o.rank], f"edge_out_{o.rank}"
        if y:
            for L in self.layouts:
                prob += pulp.lpSum(y[r, L] for (r, L2) in y if L2 == L) == z[L], f"edge_in_{L}"
        st = self.structure
        if st.head is not None and st.head.tied and "embedding" in self.slots and "head" in self.slots:
            prob += (pulp.lpSum(x["embedding", o.rank] for o in self.slots["embedding"] if o.strategy.name == "replicate")
                     == pulp.lpSum(x["head", o.rank] for o in self.slots["head"] if o.strategy.name == "replicate")), \
                "tied_embedding_head_same_layout"
        for i, (a, b, _) in enumerate(st.head_links):   # per-head state passed between them: shard both or neither
            if a in self.slots and b in self.slots:
                prob += (pulp.lpSum(x[a, o.rank] for o in self.slots[a] if o.strategy.name != "replicate")
                         == pulp.lpSum(x[b, o.rank] for o in self.slots[b] if o.strategy.name != "replicate")), \
                    f"heads_linked_{i}"
        if memory_limit is not None and objective == "time":
            prob += pulp.lpSum(mem) <= memory_limit, "memory_limit"
        if objective == "time":  # exposed data-parallel traffic (cost_models.overlap), linearised
            ov = dp_overlap(self.ctx.dp_mode)
            exposed = pulp.LpVariable("exposed_dp_comm", lowBound=0)
            prob += exposed >= pulp.lpSum(
                ((1 - ov.exposed_min) * o.dp_comm_s(self.ctx) - ov.hidden_by_compute * o.compute_s(self.ctx))
                * x[slot, o.rank] for slot, opts in self.slots.items() for o in opts) \
                + (1 - ov.exposed_min) * self.fsdp_latency(), "exposed_dp_comm_def"
            cost.append(exposed)
            cost.extend((ov.exposed_min * o.dp_comm_s(self.ctx) + o.optimizer_s(self.ctx)) * x[slot, o.rank]
                        for slot, opts in self.slots.items() for o in opts)
        prob += pulp.lpSum(mem if objective == "memory" else cost)
        solver, name = ilp_solver()
        prob.name = "tp_styles"
        t0 = time.perf_counter()
        prob.solve(solver)
        info = SolverInfo(name, pulp.LpStatus[prob.status], time.perf_counter() - t0,
                          len(prob.variables()), len(prob.constraints))
        if prob.status != pulp.LpStatusOptimal or prob.sol_status not in (pulp.LpSolutionOptimal,
                                                                          pulp.LpSolutionIntegerFeasible):
            return {}, "", info
        layout = next(L for L in self.layouts if (z[L].value() or 0) > 0.5)
        chosen = {slot: next(o for o in opts if (x[slot, o.rank].value() or 0) > 0.5)
                  for slot, opts in self.slots.items()}
        return chosen, layout, info


def _canonical(spec) -> str:
    """A style as comparable text: dict form, trailing (None, None) layout pairs dropped."""
    import json

    if hasattr(spec, "to_dict"):
        spec = spec.to_dict()
    args = dict(spec.get("args", {}))
    ins, outs = args.get("input_layouts"), args.get("desired_input_layouts")
    if isinstance(ins, list) and isinstance(outs, list):
        while ins and outs and ins[-1] is None and outs[-1] is None:
            ins, outs = ins[:-1], outs[:-1]
        args["input_layouts"], args["desired_input_layouts"] = ins, outs
    if spec["style"] == "ColwiseParallel" and args.get("input_layouts") == "Replicate()":
        del args["input_layouts"]  # ColwiseParallel's natural input
    if spec["style"] == "SequenceParallel":
        args.pop("reduce_grads", None)   # the runners reduce in backward either way (parallelisms.tensor.runner_styles)
    return json.dumps({"style": spec["style"], "args": args}, sort_keys=True)


def _optional(canonical: str) -> bool:
    """A PrepareModuleInput that only annotates replicated inputs as replicated."""
    import json

    spec = json.loads(canonical)
    if spec["style"] != "PrepareModuleInput":
        return False
    a = spec["args"]
    return a.get("input_layouts") == a.get("desired_input_layouts") and \
        all(x in (None, "Replicate()") for x in a.get("input_layouts") or [])


def _safe(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s)
