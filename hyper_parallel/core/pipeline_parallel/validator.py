"""Check a schedule before anything runs: bad orders must fail here, never hang a process group.

Checks, each error naming the rank and the step at fault:
- every action names a stage this rank owns and a micro-batch the step has;
- every (stage, micro-batch) runs one forward and one backward (B, or I followed by W);
- every send has exactly one matching receive on the peer rank (and vice versa);
- playing the order forward (sends post, receives block) finishes: no deadlock;
- MPipe (``meta["preprocess"]``): every micro-batch runs one tower forward (PRE_F) and one tower
  backward (PRE_B) on its owner rank (``preprocess_owner``), transposed sends/receives pair up
  between the owner and stage 0's rank, every rank runs REDUCE_PRE once, after its last PRE_B;
  a schedule without the flag has no MPipe action;
- optionally (``fifo=True``, for backends without message tags such as NCCL/HCCL) the sends from
  rank a to rank b are received by b in the order a sent them.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from hyper_parallel.core.pipeline_parallel.playback import _needs, play
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    PRE_COMM_KINDS, PRE_KINDS, RECV_KINDS, SEND_KINDS, ActionKind, PipelineSchedule, lower, matching, peer_of,
    preprocess_owner,
)
from hyper_parallel.errors import ScheduleError

K = ActionKind
_ON_OWNER = frozenset({K.PRE_F, K.PRE_B, K.SEND_PRE, K.RECV_PRE_B})


def _home(a, s2r) -> int | None:
    """The rank an action must run on (None: any rank, REDUCE_PRE runs on every one)."""
    if a.kind is K.REDUCE_PRE:
        return None
    if a.kind in _ON_OWNER:
        return preprocess_owner(s2r, a.microbatch)
    return s2r[a.stage]


def validate_schedule(schedule: PipelineSchedule, n_microbatches: int | None = None,
                      fifo: bool = False) -> PipelineSchedule:
    """Return the lowered schedule if it is safe to run with ``n_microbatches``; raise otherwise."""
    name = schedule.name
    m = schedule.n_microbatches if n_microbatches is None else n_microbatches
    if m != schedule.n_microbatches:
        raise ScheduleError(
            f"{name}: schedule was built for {schedule.n_microbatches} micro-batches but the step "
            f"has {m}")
    lowered = schedule if schedule.is_lowered else lower(schedule)
    s2r, n_stages = lowered.stage_to_rank, lowered.n_stages
    if len(set(s2r)) != lowered.n_ranks or max(s2r) >= lowered.n_ranks:
        raise ScheduleError(f"{name}: stage_to_rank {list(s2r)} does not cover ranks 0..{lowered.n_ranks - 1}")
    pre = bool(lowered.meta.get("preprocess"))
    counts: Counter = Counter()
    unmatched = None  # raised after the per-micro-batch counts, which name the root cause
    for r, prog in enumerate(lowered.actions):
        seen = set()
        for step, a in enumerate(prog):
            if not 0 <= a.stage < n_stages:
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} names stage {a.stage}, "
                                    f"but there are {n_stages} stages")
            is_pre = a.kind in PRE_KINDS or a.kind in PRE_COMM_KINDS or a.kind is K.REDUCE_PRE
            if is_pre and not pre:
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} is an MPipe action but the schedule "
                                    "is not an MPipe schedule (meta['preprocess'] unset; build it with mpipe())")
            if is_pre and a.stage != 0:
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} must name stage 0 (the stage the "
                                    "tower feeds)")
            if is_pre and a.kind is not K.REDUCE_PRE and a.microbatch is None:
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} needs a micro-batch")
            home = _home(a, s2r) if a.microbatch is not None or not is_pre else None
            if home is not None and home != r:
                what = "its micro-batch's tower owner" if a.kind in _ON_OWNER else f"stage {a.stage}'s rank"
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} must run on {what}, rank {home}")
            if a.microbatch is not None and not 0 <= a.microbatch < m:
                raise ScheduleError(
                    f"{name}: rank {r} step {step}: {a} names micro-batch {a.microbatch}, but the "
                    f"step has {m} micro-batches (0..{m - 1})")
            if a in seen:
                raise ScheduleError(f"{name}: rank {r} step {step}: {a} appears twice")
            seen.add(a)
            if a.is_compute:
                counts[(a.kind, a.stage, a.microbatch)] += 1
            if a.is_comm:
                peer = peer_of(a, s2r)
                if peer == r:
                    raise ScheduleError(f"{name}: rank {r} step {step}: {a} talks to its own rank; "
                                        "neighbouring stages on one rank hand over locally")
                if matching(a) not in lowered.actions[peer] and unmatched is None:
                    unmatched = ScheduleError(f"{name}: rank {r} step {step}: {a} has no matching "
                                        f"{matching(a)} on rank {peer}")
    for s in range(n_stages):
        r = s2r[s]
        for mb in range(m):
            if counts[(K.FORWARD, s, mb)] != 1:
                raise ScheduleError(f"{name}: rank {r}: stage {s} runs the forward of micro-batch "
                                    f"{mb} {counts[(K.FORWARD, s, mb)]} times (needs exactly 1)")
            full, dx, dw = (counts[(k, s, mb)] for k in (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT))
            if not ((full, dx, dw) == (1, 0, 0) or (full, dx, dw) == (0, 1, 1)):
                raise ScheduleError(
                    f"{name}: rank {r}: stage {s} micro-batch {mb} has B x{full}, I x{dx}, W x{dw}; "
                    "needs one B, or one I and one W")
    if pre:
        _check_preprocess(lowered, m, counts)
    if unmatched is not None:
        raise unmatched
    _check_local_order(lowered)
    if fifo:
        _check_fifo(lowered)
    play(lowered)
    return lowered


def _check_preprocess(s: PipelineSchedule, m: int, counts: Counter) -> None:
    for mb in range(m):
        owner = preprocess_owner(s.stage_to_rank, mb)
        for kind in (K.PRE_F, K.PRE_B):
            if counts[(kind, 0, mb)] != 1:
                raise ScheduleError(f"{s.name}: rank {owner}: the tower {'forward' if kind is K.PRE_F else 'backward'}"
                                    f" of micro-batch {mb} runs {counts[(kind, 0, mb)]} times (needs exactly 1)")
    for r, prog in enumerate(s.actions):
        at = [i for i, a in enumerate(prog) if a.kind is K.REDUCE_PRE]
        if len(at) != 1:
            raise ScheduleError(f"{s.name}: rank {r} runs REDUCE_PRE {len(at)} times (needs exactly 1: the "
                                "tower gradient sum is collective)")
        late = [i for i, a in enumerate(prog) if a.kind is K.PRE_B and i > at[0]]
        if late:
            raise ScheduleError(f"{s.name}: rank {r} step {late[0]}: {prog[late[0]]} comes after REDUCE_PRE "
                                f"(step {at[0]}); its gradient would miss the reduction")


def _check_fifo(s: PipelineSchedule) -> None:
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, prog in enumerate(s.actions):
        for step, a in enumerate(prog):
            if a.kind in SEND_KINDS:
                sends[(r, peer_of(a, s.stage_to_rank))].append((step, a))
            elif a.kind in RECV_KINDS:
                recvs[(peer_of(a, s.stage_to_rank), r)].append((step, a))
    for (src, dst), out in sends.items():
        inn = recvs[(src, dst)]
        for (ss, a), (rs, b) in zip(out, inn):
            if matching(a) != b:
                raise ScheduleError(
                    f"{s.name}: rank {dst} step {rs}: receives {b} while rank {src} step {ss} sent "
                    f"{a} first; backends without message tags need the same order on both sides")


def _check_local_order(s: PipelineSchedule) -> None:
    """A compute action whose same-rank compute input comes after it can never run."""
    last, pre = s.n_stages - 1, bool(s.meta.get("preprocess"))
    for r, prog in enumerate(s.actions):
        pos = {a: i for i, a in enumerate(prog)}
        for step, a in enumerate(prog):
            for dep in _needs(a, s.stage_to_rank, r, last, pre):
                if dep.kind == "grad":
                    cands = [pos.get(x) for x in (dep._replace_kind(K.BACKWARD), dep._replace_kind(K.BACKWARD_INPUT))]
                    later = [c for c in cands if c is not None]
                    if later and min(later) > step:
                        raise ScheduleError(f"{s.name}: rank {r} step {step}: {a} needs the input-gradient "
                                            f"of stage {dep.stage} micro-batch {dep.microbatch}, which comes "
                                            "later on the same rank")
                elif dep.kind in (K.FORWARD, K.BACKWARD_INPUT, K.PRE_F) and pos.get(dep, -1) > step:
                    raise ScheduleError(f"{s.name}: rank {r} step {step}: {a} needs {dep} which comes "
                                        "later on the same rank")
