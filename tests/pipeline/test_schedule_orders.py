"""The integer schedule orders (hyper_parallel/core/pipeline_parallel/orders.py) against
the generators they replaced, kept here verbatim as the reference: every action of every rank
equal on a grid of (schedule, p, m, v) -- uneven m, m below p, several stages per rank, and m
large enough that the greedy scheduler's periodic shortcut copies whole periods -- and the facts
the planner reads from an order (peak in-flight chunks, rank ends, FSDP gathers) equal to their
derivation from the Action IR."""
from collections import deque

import pytest

from autoplan.search.pipeline import schedule_store
from hyper_parallel.core.pipeline_parallel import generators, schedule_facts
from hyper_parallel.core.pipeline_parallel.list_scheduler import greedy_schedule
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    ActionKind as K, B, F, I, PipelineSchedule, W, loop_placement, peak_inflight, v_placement,
)
from hyper_parallel.errors import ScheduleError


# ------------------------------------------------------------------ the generators before (06e039c)

def _ref_greedy(name, stage_to_rank, m, inflight_limit, split_backward=True, cost=(1, 1, 1), w_cap=None):
    n_stages, n_ranks = len(stage_to_rank), max(stage_to_rank) + 1
    tf, ti, tw = cost
    never = 1 << 60
    f_end = [[never] * m for _ in range(n_stages)]
    b_end = [[never] * m for _ in range(n_stages)]
    next_f, next_b = [0] * n_stages, [0] * n_stages
    pending_w = [deque() for _ in range(n_ranks)]
    inflight, free_at = [0] * n_ranks, [0] * n_ranks
    orders = [[] for _ in range(n_ranks)]
    deepest_first = [sorted((s for s in range(n_stages) if stage_to_rank[s] == r), reverse=True)
                     for r in range(n_ranks)]
    last = n_stages - 1
    backward = I if split_backward else B
    b_dur = ti if split_backward else ti + tw
    total = n_stages * m * (3 if split_backward else 2)
    done, t, idle_steps = 0, 0, 0
    while done < total:
        progressed = False
        for r in range(n_ranks):
            if free_at[r] > t:
                continue
            for s in deepest_first[r]:
                mb = next_b[s]
                if mb < m and f_end[s][mb] <= t and (s == last or b_end[s + 1][mb] <= t):
                    free_at[r] = b_end[s][mb] = t + b_dur
                    next_b[s] += 1
                    inflight[r] -= 1
                    if split_backward:
                        pending_w[r].append((s, mb))
                    orders[r].append(backward(s, mb))
                    break
            else:
                if w_cap is not None and len(pending_w[r]) >= w_cap[r]:
                    orders[r].append(W(*pending_w[r].popleft()))
                    free_at[r] = t + tw
                else:
                    for s in (deepest_first[r] if inflight[r] < inflight_limit[r] else ()):
                        mb = next_f[s]
                        if mb < m and (s == 0 or f_end[s - 1][mb] <= t):
                            free_at[r] = f_end[s][mb] = t + tf
                            next_f[s] += 1
                            inflight[r] += 1
                            orders[r].append(F(s, mb))
                            break
                    else:
                        if not pending_w[r]:
                            continue
                        orders[r].append(W(*pending_w[r].popleft()))
                        free_at[r] = t + tw
            done += 1
            progressed = True
        idle_steps = 0 if progressed else idle_steps + 1
        if idle_steps > 4 * (tf + ti + tw) * n_stages + 8:
            raise ScheduleError(f"{name}: stuck")
        t += 1
    return PipelineSchedule(name, m, tuple(stage_to_rank), orders, split_backward)


def _ref(name, p, m, v=2):
    if name == "GPipe":
        return PipelineSchedule("GPipe", m, loop_placement(p, p),
                                [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)])
    if name == "1F1B":
        orders = []
        for r in range(p):
            warm = min(p - 1 - r, m)
            prog = [F(r, i) for i in range(warm)]
            for i in range(m - warm):
                prog += [F(r, warm + i), B(r, i)]
            orders.append(prog + [B(r, i) for i in range(m - warm, m)])
        return PipelineSchedule("1F1B", m, loop_placement(p, p), orders)
    if name == "Interleaved1F1B":
        if m % p:
            raise ScheduleError("m not a multiple of p")
        total = m * v

        def unit(k, forward):
            chunk = (k // p) % v
            return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

        orders = []
        for r in range(p):
            warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            prog = []
            for k in range(warm):
                c, mb = unit(k, True)
                prog.append(F(c * p + r, mb))
            for k in range(total - warm):
                c, mb = unit(warm + k, True)
                prog.append(F(c * p + r, mb))
                c, mb = unit(k, False)
                prog.append(B(c * p + r, mb))
            for k in range(total - warm, total):
                c, mb = unit(k, False)
                prog.append(B(c * p + r, mb))
            orders.append(prog)
        sched = PipelineSchedule("Interleaved1F1B", m, loop_placement(p, p * v), orders)
        sched.meta["n_virtual"] = v
        return sched
    if name == "ZeroBubble":
        return _ref_greedy("ZeroBubble", loop_placement(p, p), m, [p - r for r in range(p)])
    sched = _ref_greedy("ZBV", v_placement(p), m, [2 * p] * p, w_cap=[1] * p)
    sched.meta["n_virtual"] = 2
    return sched


def _same(a: PipelineSchedule, b: PipelineSchedule) -> bool:
    return (a.name, a.n_microbatches, a.stage_to_rank, a.actions, a.uses_split_backward, a.meta) == \
        (b.name, b.n_microbatches, b.stage_to_rank, b.actions, b.uses_split_backward, b.meta)


GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 24, 40)] \
    + [(16, 8), (16, 64), (16, 100), (32, 256)]


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV"])
def test_orders_equal_the_generators_they_replaced(name):
    facts = schedule_facts(name)
    for p, m in GRID:
        for v in ((1, 2, 3) if facts.virtual_configurable else (1,)):
            try:
                want = _ref(name, p, m, v)
            except ScheduleError:
                with pytest.raises(ScheduleError):
                    facts.generator(p, m, **facts.generator_kwargs(v))
                continue
            got = facts.generator(p, m, **facts.generator_kwargs(v))
            assert _same(got, want), (name, p, m, v)


def test_greedy_with_other_costs_and_a_whole_backward_equals_the_plain_play():
    """The shortcuts apply to unit times with split backward only; the rest is the plain play."""
    for p, m in [(2, 5), (4, 8), (4, 13), (6, 20)]:
        for cost, split in [((2, 1, 1), True), ((1, 2, 3), True), ((1, 1, 1), False), ((1, 1, 2), False)]:
            for s2r, limits, cap in [(loop_placement(p, p), [p - r for r in range(p)], None),
                                     (v_placement(p), [2 * p] * p, [1] * p)]:
                try:
                    want = _ref_greedy("g", s2r, m, limits, split, cost, cap)
                except ScheduleError:
                    with pytest.raises(ScheduleError):
                        greedy_schedule("g", s2r, m, limits, split, cost, cap)
                    continue
                got = greedy_schedule("g", s2r, m, limits, split, cost, cap)
                assert _same(got, want), (p, m, cost, split)


# ------------------------------------------------------------------ the facts the planner reads

def _ref_rank_ends(ir):
    out = []
    for r, prog in enumerate(ir.actions):
        last = prog[-1]
        out.append((prog[0].stage, (last.kind in (K.BACKWARD, K.BACKWARD_INPUT), last.stage),
                    tuple(s for s, rr in enumerate(ir.stage_to_rank) if rr == r)))
    return tuple(out)


def _ref_gathers(ir):
    out = [0] * ir.n_stages
    for prog in ir.actions:
        sharded = {}
        for a in prog:
            if a.kind is K.FORWARD:
                out[a.stage] += sharded.get(a.stage, True)
                sharded[a.stage] = True
            elif a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
                out[a.stage] += sharded.get(a.stage, True)
                sharded[a.stage] = False
    return tuple(out)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV"])
def test_facts_from_orders_equal_the_ir_derivation(name, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPLAN_DISK_CACHE", "0")
    schedule_store.clear()
    for p, m in [(2, 4), (3, 7), (4, 8), (4, 16), (8, 24)]:
        try:
            ir = schedule_facts(name).ir(p, m, 2)
        except ScheduleError:
            continue
        s2r, peaks = schedule_store.placement(name, p, m, 2)
        assert s2r == ir.stage_to_rank
        assert peaks == tuple(peak_inflight(prog) for prog in ir.actions)
        assert peaks == schedule_facts(name).inflight(p, m, 2)
        assert schedule_store.rank_ends(name, p, m, 2) == _ref_rank_ends(ir)
        assert schedule_store.fsdp_gathers(name, p, m, 2) == _ref_gathers(ir)
    schedule_store.clear()


def test_generators_keep_their_signature():
    """The runtime classes and the schedule table read ``n_virtual`` from the signature."""
    assert schedule_facts("Interleaved1F1B").virtual_configurable
    assert not schedule_facts("ZBV").virtual_configurable
    assert generators.interleaved_1f1b.order(4, 8, n_virtual=2).n_virtual == 2
