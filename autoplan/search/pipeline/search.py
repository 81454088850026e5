"""Pipeline cuts, schedule and micro-batch count, chosen together and timed by the simulator.

Why this shape: the step time of a pipeline is set by its slowest stage (every micro-batch passes
through it) plus the bubble of the schedule, and a stage must hold its weights plus the
activations of the micro-batches the schedule keeps in flight on its rank. So for each
(schedule, stages, micro-batches) we

1. place the cuts by an exact min-max partition of the unit sequence (embedding, blocks, final
   norm, head, each priced by the TP plan) under per-stage memory limits: bisection on the
   bottleneck time with a greedy feasibility test (greedy is optimal for contiguous partitions
   whose per-stage constraints are monotone in the range; the exchange argument is in
   ``balanced_cuts``). The even split experts use is kept as a second candidate;
2. time the stage costs on the very schedule IR the runtime executes (``build_schedule`` +
   ``validate_schedule`` + ``play``, the engine of ``simulate``), with a P2P hop per boundary;
3. check every rank's memory with the simulator's in-flight micro-batch count for that rank.

Validation of a schedule IR is the slow part of ``simulate`` (seconds at p=16, m=128); the lowered
IR depends only on (schedule, p, m, v), so it is cached here; ``play`` then times each cost vector.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Sequence

from autoplan.errors import InfeasiblePlanError
from autoplan.search.pipeline import schedule_store
from autoplan.search.pipeline.schedule_timing import compile_schedule, time_schedule
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, StageCost, schedule_facts
from hyper_parallel.errors import ScheduleError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitCost:
    """One pipeline unit (a cut point of the runtime's split) per micro-batch on one rank: forward, backward-input and
    backward-weight seconds (tensor-parallel collectives included), bytes of parameter state
    (params + grads + optimizer, after FSDP), saved activation bytes per micro-batch, and its
    data-parallel communication seconds per step (FSDP: two all-gathers and a reduce-scatter;
    a pipeline gathers a block again whenever it finds it resharded, see ``fsdp_gathers``)."""

    name: str
    forward: float
    backward_input: float
    backward_weight: float
    state_bytes: float = 0.0
    act_bytes: float = 0.0
    dp_comm_s: float = 0.0
    dp_gather_s: float = 0.0   # one FSDP all-gather of this unit if it is its own FSDP unit (a block)
    optimizer_s: float = 0.0   # its share of the optimizer step, once per step after backward
    fsdp: bool = False         # its dp traffic is FSDP's: issued again by every micro-batch of one stage

    @property
    def time(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


@dataclass
class PipelineChoice:
    """A timed pipeline: schedule, ranks (p), virtual stages per rank (v), micro-batches (m), the
    unit index where each stage starts (``starts``, first is 0), and what the simulator said."""

    schedule: str
    p: int
    v: int
    m: int
    starts: list[int]
    step_s: float = float("nan")
    sim_step_s: float = float("nan")
    bubble_fraction: float = float("nan")
    busy_s: list[float] = field(default_factory=list)
    rank_memory: list[float] = field(default_factory=list)
    peak_inflight: list[int] = field(default_factory=list)
    per_stage: list[dict] = field(default_factory=list)
    cut_method: str = "balanced"

    @property
    def n_stages(self) -> int:
        return len(self.starts)


def play_costs(name: str, p: int, m: int, v: int, costs: Sequence, p2p_time: float):
    """(step_time, bubble_fraction, busy per rank, peak in-flight per rank): ``simulate``'s
    numbers for per-stage StageCosts, on the cached lowered IR (timed by its compiled form,
    ``schedule_timing``, which equals ``playback.play``)."""
    step, busy = time_schedule(compile_schedule(name, p, m, v), costs, p2p_time)
    top = max(busy) if busy else 0.0
    peaks = list(schedule_store.placement(name, p, m, v)[1])
    return step, ((step - top) / top if top > 0 else 0.0), busy, peaks


# ------------------------------------------------------------------ cuts

def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for x in values:
        out.append(out[-1] + x)
    return out


def balanced_cuts(times: Sequence[float], states: Sequence[float], acts: Sequence[float], n_stages: int,
                  inflight: Sequence[float], budgets: Sequence[float], min_units: int = 1) -> list[int] | None:
    """Starts of ``n_stages`` contiguous stages minimising the largest stage time, such that stage j
    holds ``sum(states) + inflight[j] * sum(acts) <= budgets[j]``; None if no split fits.

    Exact for this objective: for a bottleneck T, greedily extending each stage as far as T, its
    memory budget and the units the later stages still need allow is optimal (by induction the
    greedy stage j ends no earlier than stage j of any feasible split, because a sub-range of a
    feasible range is feasible). Feasibility is monotone in T, so bisection finds the least T.
    """
    n = len(times)
    if n_stages < 1 or n_stages * min_units > n:
        return None
    pt, ps, pa = _prefix(times), _prefix(states), _prefix(acts)

    def greedy(limit_t: float) -> list[int] | None:
        starts, i = [], 0
        for j in range(n_stages):
            starts.append(i)
            hi = n - (n_stages - 1 - j) * min_units
            if j == n_stages - 1:
                e = n
                if pt[e] - pt[i] > limit_t * (1 + 1e-12) or \
                        (ps[e] - ps[i]) + inflight[j] * (pa[e] - pa[i]) > budgets[j]:
                    return None
            else:
                e = bisect.bisect_right(pt, pt[i] + limit_t * (1 + 1e-12), i, hi + 1) - 1
                # memory is monotone in e too: shrink until it fits
                lo_e, hi_e = i, e
                while lo_e < hi_e:
                    mid = (lo_e + hi_e + 1) // 2
                    if (ps[mid] - ps[i]) + inflight[j] * (pa[mid] - pa[i]) <= budgets[j]:
                        lo_e = mid
                    else:
                        hi_e = mid - 1
                e = min(e, lo_e)
                if e - i < min_units:
                    return None
            i = e
        return starts

    lo, hi = max(times) if times else 0.0, pt[-1]
    best = greedy(hi)
    if best is None:
        return None
    for _ in range(60):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        g = greedy(mid)
        if g is None:
            lo = mid
        else:
            hi, best = mid, g
    return best


def ramp_floor(units: Sequence[UnitCost], p: int, m: int) -> float:
    """min over cuts into p stages of max_j (forwards of stages before j + m x work of stage j):
    a lower bound on the simulated step of any one-stage-per-rank schedule (GPipe, 1F1B, ZB-H1:
    rank j's first action is stage j's forward, which waits for the forward chain before it).
    Exact by bisection with a greedy test (the offset grows with a stage's start)."""
    n = len(units)
    if p > n:
        return float("inf")
    pt, pf = _prefix([u.time for u in units]), _prefix([u.forward for u in units])

    def fits(x: float) -> bool:
        i = 0
        for j in range(p):
            hi = n - (p - 1 - j)
            if j == p - 1:
                return pf[i] + m * (pt[n] - pt[i]) <= x * (1 + 1e-12)
            e = bisect.bisect_right(pt, pt[i] + (x * (1 + 1e-12) - pf[i]) / m, i, hi + 1) - 1
            if e <= i:
                return False
            i = e
        return True

    lo, hi = 0.0, pf[n] + m * pt[n]
    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


def even_starts(n_units: int, n_stages: int, first_blocks: int = 1, tail: int = 2) -> list[int] | None:
    """The experts' even split (torchtitan / ``even_cuts``): blocks spread evenly, the embedding
    with the first stage, the final norm and head with the last."""
    blocks = n_units - first_blocks - tail
    if n_stages > blocks or n_stages < 1:
        return None
    per, extra = divmod(blocks, n_stages)
    starts, i = [0], first_blocks
    for s in range(n_stages - 1):
        i += per + (1 if s < extra else 0)
        starts.append(i)
    return starts


def stage_bounds(starts: Sequence[int], n_units: int) -> list[tuple[int, int]]:
    ends = list(starts[1:]) + [n_units]
    return list(zip(starts, ends))


# ------------------------------------------------------------------ timing one choice

def time_choice(choice: PipelineChoice, units: Sequence[UnitCost], p2p_time: float,
                exposed_dp=None) -> PipelineChoice:
    """Simulate ``choice`` (its cuts fixed) and fill step time, bubble, memory per rank and the
    per-stage rows. ``exposed_dp(dp_comm_s, busy_s)`` prices the data-parallel communication a
    rank cannot hide (added once per step; default: all of it)."""
    bounds = stage_bounds(choice.starts, len(units))
    stage_costs, stage_rows = [], []
    for a, b in bounds:
        seg = units[a:b]
        stage_costs.append(StageCost(sum(u.forward for u in seg), sum(u.backward_input for u in seg),
                                     sum(u.backward_weight for u in seg)))
        stage_rows.append({"state": sum(u.state_bytes for u in seg), "act": sum(u.act_bytes for u in seg),
                           "dp_comm_s": _stage_dp(choice, units, len(stage_rows), a, b)})
    hop = p2p_time if choice.p > 1 else 0.0
    if choice.p == 1:  # one stage: gradient accumulation, m forwards and backwards back to back, one live
        busy1 = choice.m * sum(c.forward + c.backward for c in stage_costs)
        step, bubble, busy, peaks = busy1, 0.0, [busy1], [1]
    else:
        step, bubble, busy, peaks = play_costs(choice.schedule, choice.p, choice.m, choice.v, stage_costs, hop)
    s2r = schedule_store.placement(choice.schedule, choice.p, choice.m, choice.v)[0]
    mem = [0.0] * choice.p
    act_rank = [0.0] * choice.p
    n_on = [0] * choice.p
    dp_rank = [0.0] * choice.p
    for s, row in enumerate(stage_rows):
        r = s2r[s]
        mem[r] += row["state"]
        act_rank[r] += row["act"]
        n_on[r] += 1
        dp_rank[r] += row["dp_comm_s"]
    for r in range(choice.p):  # in-flight chunks x the mean activation of this rank's stages
        mem[r] += peaks[r] * act_rank[r] / max(n_on[r], 1)
    opt = _rank_optimizer(choice, units)
    exposed = [(exposed_dp(dp_rank[r], busy[r]) if exposed_dp else dp_rank[r]) + opt[r] for r in range(choice.p)]
    choice.sim_step_s, choice.bubble_fraction, choice.busy_s = step, bubble, busy
    choice.step_s = step + max(exposed)
    choice.rank_memory, choice.peak_inflight = mem, peaks
    choice.per_stage = []
    for s, ((a, b), c, row) in enumerate(zip(bounds, stage_costs, stage_rows)):
        r = s2r[s]
        compute = choice.m * (c.forward + c.backward)
        choice.per_stage.append({
            "stage": s, "rank": r, "units": [a, b], "compute_s": compute,
            "comm_s": exposed[r] + (2 * choice.m * hop if choice.p > 1 else 0.0),
            "bubble_s": max(0.0, step - busy[r]), "memory_bytes": mem[r]})
    return choice


def _rank_ends(name: str, p: int, m: int, v: int) -> tuple:
    """Per rank: (stage of its first compute, (kind, stage) of its last compute, its stages)."""
    return schedule_store.rank_ends(name, p, m, v)


def fsdp_gathers(name: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """All-gathers of a block's FSDP unit per stage in one step, as the runtime runs FSDP inside a
    pipeline (fsdp_actions.py): resharded after every forward, kept unsharded after backward
    until the step ends; so a forward or backward that finds it resharded gathers it."""
    return schedule_store.fsdp_gathers(name, p, m, v)


def _stage_dp(choice: PipelineChoice, units: Sequence[UnitCost], s: int, a: int, b: int) -> float:
    if choice.p == 1:
        # one stage accumulates gradients (Runner.forward_backward): FSDP2 gathers and
        # reduce-scatters every micro-batch, replicated dp / ZeRO-1 reduce once per step
        return sum(u.dp_comm_s * (choice.m if u.fsdp else 1) for u in units[a:b])
    # a pipeline stage's FSDP keeps a block unsharded from its backward until the step ends
    # (fsdp_actions.py), so m micro-batches re-gather only what the schedule finds resharded
    extra = fsdp_gathers(choice.schedule, choice.p, choice.m, choice.v)[s] - 2
    return sum(u.dp_comm_s + extra * u.dp_gather_s for u in units[a:b])


def lower_bound(choice: PipelineChoice, units: Sequence[UnitCost]) -> float:
    """A step time the simulator cannot beat for these cuts and this schedule: for every rank,
    the forward chain before its first action (stages before it must run first) + its compute
    + the input-gradient chain after its last backward (it must flow down to stage 0)."""
    bounds = stage_bounds(choice.starts, len(units))
    fwd = [sum(u.forward for u in units[a:b]) for a, b in bounds]
    dx = [sum(u.backward_input for u in units[a:b]) for a, b in bounds]
    tot = [sum(u.time for u in units[a:b]) for a, b in bounds]
    best = 0.0
    for first, (ends_in_dx, last), stages in _rank_ends(choice.schedule, choice.p, choice.m, choice.v):
        head = sum(fwd[:first])
        tail = sum(dx[:last]) if ends_in_dx else 0.0
        best = max(best, head + choice.m * sum(tot[s] for s in stages) + tail)
    return best


def rank_memory(choice: PipelineChoice, units: Sequence[UnitCost]) -> list[float]:
    """Bytes per rank: its stages' parameter state + its peak in-flight chunks x the mean
    activation per chunk of its stages (known before timing: in-flight counts are a property of
    the schedule's order)."""
    s2r = schedule_store.placement(choice.schedule, choice.p, choice.m, choice.v)[0]
    # one stage: gradient accumulation holds one micro-batch's activations at a time
    peaks = schedule_store.placement(choice.schedule, choice.p, choice.m, choice.v)[1] if choice.p > 1 else (1,)
    state, act, n_on = [0.0] * choice.p, [0.0] * choice.p, [0] * choice.p
    for s, (a, b) in enumerate(stage_bounds(choice.starts, len(units))):
        r = s2r[s] if choice.p > 1 else 0
        state[r] += sum(u.state_bytes for u in units[a:b])
        act[r] += sum(u.act_bytes for u in units[a:b])
        n_on[r] += 1
    return [state[r] + peaks[r] * act[r] / max(n_on[r], 1) for r in range(choice.p)]


def _rank_optimizer(choice: PipelineChoice, units: Sequence[UnitCost]) -> list[float]:
    """Optimizer step seconds per rank (its stages' units)."""
    s2r = schedule_store.placement(choice.schedule, choice.p, choice.m, choice.v)[0] if choice.p > 1 else (0,)
    out = [0.0] * choice.p
    for s, (a, b) in enumerate(stage_bounds(choice.starts, len(units))):
        out[s2r[s]] += sum(u.optimizer_s for u in units[a:b])
    return out


def full_lower_bound(choice: PipelineChoice, units: Sequence[UnitCost], exposed_dp=None) -> float:
    """``lower_bound`` plus the data-parallel time ``time_choice`` adds, which is exact before
    simulating (it depends only on each rank's compute and dp traffic)."""
    return lower_bound(choice, units) + max(_exposed(choice, units, exposed_dp))


def _exposed(choice: PipelineChoice, units: Sequence[UnitCost], exposed_dp=None) -> list[float]:
    s2r = schedule_store.placement(choice.schedule, choice.p, choice.m, choice.v)[0]
    busy, dp = [0.0] * choice.p, [0.0] * choice.p
    for s, (a, b) in enumerate(stage_bounds(choice.starts, len(units))):
        busy[s2r[s]] += choice.m * sum(u.time for u in units[a:b])
        dp[s2r[s]] += _stage_dp(choice, units, s, a, b)
    opt = _rank_optimizer(choice, units)
    return [(exposed_dp(d, c) if exposed_dp else d) + o for d, c, o in zip(dp, busy, opt)]


def estimate(choice: PipelineChoice, units: Sequence[UnitCost], p2p_time: float) -> float:
    """Closed-form step estimate (formulas.md bubbles) used only to order simulations."""
    bounds = stage_bounds(choice.starts, len(units))
    t_stage = max(sum(u.time for u in units[a:b]) for a, b in bounds)
    # a drain term for ordering only: (p-1)/3 stage times where the backward runs whole, none where
    # deferred dw work fills the drain (split backward)
    frac = 0.0 if schedule_facts(choice.schedule).split_backward else 1 / 3
    return lower_bound(choice, units) + frac * (choice.p - 1) * t_stage + 2 * (choice.n_stages - 1) * p2p_time


# ------------------------------------------------------------------ candidates for one mesh

def pipeline_candidates(units: Sequence[UnitCost], p: int, microbatches: Sequence[int], memory_limit: float,
                        schedules: Sequence[str] = SCHEDULE_NAMES, virtual: Sequence[int] = (2,),
                        include_even: bool = True, bound: float = float("inf"),
                        extra: float = 0.0) -> list[PipelineChoice]:
    """Every (schedule, v, m) on ``p`` ranks whose cuts fit memory, with balanced (and even) cuts;
    untimed (see ``time_choice``). With p == 1 the only schedule is one stage doing m micro-batches.

    ``bound``: skip (without generating its IR, the costly part) a schedule that cannot beat it
    for any cut: ``ramp_floor`` + ``extra`` for one stage per rank, m x total / p + ``extra``
    otherwise."""
    out = []
    n = len(units)
    times = [u.time for u in units]
    states = [u.state_bytes for u in units]
    acts = [u.act_bytes for u in units]
    if p == 1:
        for m in microbatches:
            c = PipelineChoice("1F1B", 1, 1, m, [0])
            if sum(states) + sum(acts) <= memory_limit:   # one stage: one micro-batch in flight
                out.append(c)
        return out
    ramps: dict[int, float] = {}
    for name in schedules:
        facts = schedule_facts(name, "schedules[]")
        for v in (virtual if facts.virtual_configurable else (1,)):
            vv = facts.stages_per_rank(v)
            n_st = p * vv
            if n_st > n:
                continue
            for m in microbatches:
                if vv == 1 and m not in ramps:
                    ramps[m] = ramp_floor(units, p, m)
                floor = (ramps[m] if vv == 1 else m * sum(times) / p) + extra
                if floor >= bound:
                    continue
                try:
                    s2r, infl = schedule_store.placement(name, p, m, v)
                except ScheduleError:
                    continue
                per_rank = [sum(1 for r in s2r if r == rr) for rr in range(p)]
                inflight = [infl[s2r[s]] / per_rank[s2r[s]] for s in range(n_st)]
                budgets = [memory_limit / per_rank[s2r[s]] for s in range(n_st)]
                cand = []
                starts = balanced_cuts(times, states, acts, n_st, inflight, budgets)
                if starts is not None:
                    cand.append((starts, "balanced"))
                if include_even:
                    ev = even_starts(n, n_st)
                    if ev is not None and ev != starts:
                        cand.append((ev, "even"))
                for st, how in cand:
                    c = PipelineChoice(name, p, vv, m, list(st), cut_method=how)
                    if max(rank_memory(c, units)) <= memory_limit:
                        out.append(c)
    return out


def search_pipeline(units: Sequence[UnitCost], p: int, microbatches: Sequence[int], memory_limit: float,
                    p2p_time: float, exposed_dp=None, schedules: Sequence[str] = SCHEDULE_NAMES,
                    virtual: Sequence[int] = (2,), max_simulations: int | None = None) -> list[PipelineChoice]:
    """The fitting pipelines of one mesh, timed and sorted by step time (best first).

    Candidates are simulated in order of their closed-form estimate; once the busiest-rank lower
    bound of the next one is no better than the best simulated step, the rest cannot win and are
    skipped (branch and bound), so the answer equals simulating them all.
    """
    cands = pipeline_candidates(units, p, microbatches, memory_limit, schedules, virtual)
    if not cands:
        raise InfeasiblePlanError(f"pipeline search: no cut of {len(units)} units into {p} ranks fits "
                                  f"{memory_limit / 2**30:.2f} GiB with micro-batches {list(microbatches)}")
    keyed = sorted(cands, key=lambda c: (estimate(c, units, p2p_time), c.schedule, c.m, c.starts))
    done, best = [], float("inf")
    for c in keyed:
        if lower_bound(c, units) >= best or (max_simulations is not None and len(done) >= max_simulations):
            continue
        time_choice(c, units, p2p_time, exposed_dp)
        if max(c.rank_memory) > memory_limit:
            continue
        done.append(c)
        best = min(best, c.step_s)
    done.sort(key=lambda c: (c.step_s, c.schedule, c.m, c.starts))
    return done
