"""The simulator's timing of a schedule IR, compiled once per (schedule, p, m, v).

Why: the planner times hundreds of cost vectors on the same few schedule IRs. ``playback.play``
re-derives every dependency with Action objects and dict look-ups on each call (~0.1 s at p=16,
m=128). The order in which ``play`` can process actions, and what each receive waits for, do not
depend on the durations, so they are derived here once and each timing is a flat loop over
integer triples. It returns exactly what ``play`` gives (tests/search_pp compare them on random
costs; tests/search_pp/test_schedule_timing.py compares every step with the lowered IR's).

Why so little is kept (ZBV at p=64, m=2048 has 1.8 million lowered actions and its
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

import numpy as np

from autoplan import disk_cache
from autoplan.search.pipeline.schedule_store import GENERATOR_CODE, normalised_v
from hyper_parallel.core.pipeline_parallel import schedule_facts
from hyper_parallel.core.pipeline_parallel.orders import ComputeOrder
from hyper_parallel.errors import ScheduleError

# a compute action's duration slot is its order code's slot (orders.py): forward, full backward,
# backward-input, backward-weight
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


def _programs(order: ComputeOrder) -> list[tuple[list[int], list[int]]]:
    """Per rank, (whats, args) of the lowered program: ``lower``'s receives and sends around the
    compute actions (send keys: 2 * (stage * m + micro-batch) for a forward output, + 1 for a
    gradient), built from the integer order without Action objects."""
    s2r = np.asarray(order.stage_to_rank, dtype=np.int64)
    last, m = order.n_stages - 1, order.n_microbatches
    out = []
    for r in range(order.n_ranks):
        code = order.codes[r]
        slot, sm = code & 3, code >> 2
        s, mb = np.divmod(sm, m)
        prev_remote = (s > 0) & (s2r[np.maximum(s - 1, 0)] != r)
        next_remote = (s < last) & (s2r[np.minimum(s + 1, last)] != r)
        fwd, grad = slot == 0, (slot == 1) | (slot == 2)
        recv_f, recv_b = fwd & prev_remote, grad & next_remote
        send_f, send_b = fwd & next_remote, grad & prev_remote
        n = len(code)
        whats = np.empty((n, 3), dtype=np.int64)
        args = np.zeros((n, 3), dtype=np.int64)
        whats[:, 0], whats[:, 1], whats[:, 2] = _RECV, s * 4 + slot, _SEND
        args[:, 0] = np.where(recv_f, 2 * (sm - m), 2 * (sm + m) + 1)
        args[:, 2] = np.where(send_f, 2 * sm, 2 * sm + 1)
        keep = np.stack([recv_f | recv_b, np.ones(n, dtype=bool), send_f | send_b], axis=1)
        out.append((whats[keep].tolist(), args[keep].tolist()))
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
    order = schedule_facts(name).order(p, m, v)
    progs = _programs(order)
    n_keys = 2 * order.n_stages * order.n_microbatches
    sent = bytearray(n_keys)
    for whats_r, args_r in progs:
        for what, key in zip(whats_r, args_r):
            if what == _SEND:
                sent[key] = 1
    done = bytearray(n_keys)
    ranks, whats, args = array("i"), array("i"), array("i")
    ptr = [0] * len(progs)
    parked: dict[int, int] = {}         # send key -> the rank whose next action receives it
    ready = list(range(len(progs)))
    while ready:
        r = ready.pop()
        (whats_r, args_r), i = progs[r], ptr[r]
        n = len(whats_r)
        while i < n:
            what, key = whats_r[i], args_r[i]
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
    if any(ptr[r] < len(prog[0]) for r, prog in enumerate(progs)):
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
