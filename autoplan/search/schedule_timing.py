"""The simulator's timing of a schedule IR, compiled once per (schedule, p, m, v).

Why: the planner times hundreds of cost vectors on the same few schedule IRs. ``playback.play``
re-derives every dependency with Action objects and dict look-ups on each call (~0.1 s at p=16,
m=128). The order in which ``play`` can process actions, and what each receive waits for, do not
depend on the durations, so they are derived here once and each timing is a flat loop over
integer triples. It returns exactly what ``play`` gives (tests/search_pp compare them on random
costs; tests/search_pp/test_schedule_timing.py compares every step with the lowered IR's).

Why so little is kept (issue 35: ZBV at p=64, m=2048 has 1.8 million lowered actions and its
compile took most of a cold 405B / 128K plan): a rank runs its program in order, so every local
dependency (``playback._needs``: the previous stage's forward on this rank, the gradient from
this rank's later stage, the receive in front) ended before the rank's clock reached the action
-- durations are ``StageCost`` times, finite and >= 0, so a rank's clock never goes back. The
only waits that can move a clock are receives, for the matching send of another rank, and a
send ends at its rank's clock (it has no duration). So the compiled form is, per action in one
processing order: a compute slot (adds its duration to the rank's clock and busy time), a send
(records the rank's clock) or a receive (waits for the recorded clock plus the P2P time). The
point-to-point actions are those ``lower`` inserts (a receive right before the consumer, a send
right after the producer, none between stages of one rank), derived from the compute IR without
building the lowered one. Compiled forms are kept on disk (``autoplan.disk_cache``) under the
hash of the generator code and this module, beside the schedule facts (``schedule_store``).
"""
from __future__ import annotations

import functools
import json
from array import array
from dataclasses import dataclass

from autoplan import disk_cache
from autoplan.search.schedule_store import GENERATOR_CODE, normalised_v
from hyper_parallel.core.pipeline_parallel import schedule_facts
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind as K
from hyper_parallel.errors import ScheduleError

# duration slots per compute action: forward, full backward, backward-input, backward-weight
_SLOT = {K.FORWARD: 0, K.BACKWARD: 1, K.BACKWARD_INPUT: 2, K.BACKWARD_WEIGHT: 3}
_SEND, _RECV = -1, -2


@dataclass(frozen=True)
class CompiledSchedule:
    """Per action in one processing order (three parallel int arrays): its rank, ``what`` and
    ``arg``. ``what`` >= 0 is a compute action whose duration is ``durations[what]`` (stage * 4 +
    slot), ``_SEND`` records the rank's clock in ``arg`` (a send's key), ``_RECV`` waits for the
    clock recorded in ``arg`` plus the P2P time."""

    n_ranks: int
    n_keys: int
    ranks: array
    whats: array
    args: array

    def to_bytes(self) -> bytes:
        head = json.dumps([self.n_ranks, self.n_keys, len(self.ranks)]).encode() + b"\n"
        return head + self.ranks.tobytes() + self.whats.tobytes() + self.args.tobytes()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "CompiledSchedule":
        head, _, body = raw.partition(b"\n")
        n_ranks, n_keys, n = json.loads(head)
        arrays = [array("i") for _ in range(3)]
        size = arrays[0].itemsize * n
        if len(body) != 3 * size:
            raise ValueError("truncated compiled schedule")
        for k, a in enumerate(arrays):
            a.frombytes(body[k * size:(k + 1) * size])
        return cls(n_ranks, n_keys, *arrays)


def _programs(ir) -> list[list[tuple[int, int]]]:
    """Per rank, (what, arg) of the lowered program: ``lower``'s receives and sends around the
    compute actions (send keys: 2 * (stage * m + micro-batch) for a forward output, + 1 for a
    gradient)."""
    s2r, last, m = ir.stage_to_rank, ir.n_stages - 1, ir.n_microbatches
    out = []
    for r, prog in enumerate(ir.actions):
        ops: list[tuple[int, int]] = []
        for a in prog:
            kind, s, mb = a.kind, a.stage, a.microbatch
            slot = _SLOT.get(kind)
            if slot is None or mb is None or not 0 <= mb < m:
                raise ScheduleError(f"{ir.name}: rank {r}: {a} is not a compute action of micro-batch < {m}")
            if slot == 0 and s > 0 and s2r[s - 1] != r:
                ops.append((_RECV, 2 * ((s - 1) * m + mb)))
            grad = slot in (1, 2)
            if grad and s < last and s2r[s + 1] != r:
                ops.append((_RECV, 2 * ((s + 1) * m + mb) + 1))
            ops.append((s * 4 + slot, 0))
            if slot == 0 and s < last and s2r[s + 1] != r:
                ops.append((_SEND, 2 * (s * m + mb)))
            if grad and s > 0 and s2r[s - 1] != r:
                ops.append((_SEND, 2 * (s * m + mb) + 1))
        out.append(ops)
    return out


@functools.lru_cache(maxsize=256)
def compile_schedule(name: str, p: int, m: int, v: int = 1) -> CompiledSchedule:
    """``_compile``, read from the disk cache when an earlier process compiled it."""
    v = normalised_v(name, v)
    key = f"compiled {name} {p} {m} {v}"
    version = disk_cache.code_version(*GENERATOR_CODE, __file__)   # the generators and this compiler
    raw = disk_cache.load("schedules", version, key)
    if raw is not None:
        try:
            return CompiledSchedule.from_bytes(raw)
        except ValueError:
            pass   # a damaged entry: compiled again and rewritten below
    out = _compile(name, p, m, v)
    disk_cache.store("schedules", version, key, out.to_bytes())
    return out


def _compile(name: str, p: int, m: int, v: int) -> CompiledSchedule:
    """One processing order of the lowered schedule: each rank runs until a receive whose send
    has not run, and a send wakes the rank parked on its receive. Any such order times the same
    (a rank's clock and every end time are fixed by the dependencies), and this one visits each
    action once. Raises ScheduleError on a receive without a send or a deadlock."""
    ir = schedule_facts(name).ir(p, m, v)
    if ir.meta.get("preprocess"):
        raise ScheduleError(f"{name}: the planner times schedules without a preprocess tower")
    progs = _programs(ir)
    n_keys = 2 * ir.n_stages * ir.n_microbatches
    sent = bytearray(n_keys)
    for prog in progs:
        for what, key in prog:
            if what == _SEND:
                sent[key] = 1
    done = bytearray(n_keys)
    ranks, whats, args = array("i"), array("i"), array("i")
    ptr = [0] * len(progs)
    parked: dict[int, int] = {}         # send key -> the rank whose next action receives it
    ready = list(range(len(progs)))
    while ready:
        r = ready.pop()
        prog, i = progs[r], ptr[r]
        n = len(prog)
        while i < n:
            what, key = prog[i]
            if what == _RECV:
                if not sent[key]:
                    raise ScheduleError(f"{name}: rank {r} step {i}: a receive (key {key}) has no matching send")
                if not done[key]:
                    parked[key] = r
                    break
            ranks.append(r)
            whats.append(what)
            args.append(key)
            i += 1
            if what == _SEND:
                done[key] = 1
                waiting = parked.pop(key, None)
                if waiting is not None:
                    ready.append(waiting)
        ptr[r] = i
    if any(ptr[r] < len(prog) for r, prog in enumerate(progs)):
        raise ScheduleError(f"{name}: the order deadlocks (p={p}, m={m})")
    return CompiledSchedule(len(progs), n_keys, ranks, whats, args)


def time_schedule(cs: CompiledSchedule, costs, p2p_time: float) -> tuple[float, list[float]]:
    """(step time, busy seconds per rank) of ``costs`` (one StageCost per stage) on ``cs``: the
    same sums, in the same order, as ``playback.play``."""
    durations = []
    for c in costs:
        durations += (c.forward, c.backward_input + c.backward_weight, c.backward_input, c.backward_weight)
    clock = [0.0] * cs.n_ranks
    busy = [0.0] * cs.n_ranks
    posted = [0.0] * cs.n_keys
    for r, what, key in zip(cs.ranks.tolist(), cs.whats.tolist(), cs.args.tolist()):
        if what >= 0:
            d = durations[what]
            clock[r] += d
            busy[r] += d
        elif what == _SEND:
            posted[key] = clock[r]
        else:
            t = posted[key] + p2p_time
            if t > clock[r]:
                clock[r] = t
    # a send's clock is when it was posted; its arrival adds p2p_time (applied at the receive)
    step = max(clock) if clock else 0.0
    return step, busy
