"""Compute orders as integer codes: what every schedule generator builds first.

Why: the planner prices every (schedule, p, m, v) a mesh allows and reads a few integers per rank
from each order (peak in-flight chunks, where each rank's work starts and ends, FSDP gathers, the
compiled timing). At p=64-128 and m=1024-2048 an order holds up to 1.6 million actions; building
them as :class:`Action` objects took most of a first-ever 405B plan at 128K positions.
So a generator builds the order as one integer array per rank (numpy, in closed form where the
schedule has one; the greedy list scheduler emits integers too), the planner reads the arrays, and
the runtime's :class:`PipelineSchedule` is decoded from the same arrays: one order, two views.

A code is ``(stage * m + microbatch) * 4 + slot`` with slot 0 = F, 1 = B, 2 = I, 3 = W.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hyper_parallel.core.pipeline_parallel.schedule_ir import B, F, I, W, PipelineSchedule

SLOT_F, SLOT_B, SLOT_I, SLOT_W = 0, 1, 2, 3
_MAKE = (F, B, I, W)


@dataclass(frozen=True, eq=False)
class ComputeOrder:
    """A generator's compute order: per rank an int64 array of codes (module docstring)."""

    name: str
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    codes: tuple[np.ndarray, ...]
    split_backward: bool = False
    n_virtual: int | None = None   # the IR's meta["n_virtual"] where the generator sets it

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def n_ranks(self) -> int:
        return len(self.codes)

    def slots(self, rank: int) -> np.ndarray:
        return self.codes[rank] & 3

    def stages(self, rank: int) -> np.ndarray:
        return (self.codes[rank] >> 2) // self.n_microbatches

    def schedule(self) -> PipelineSchedule:
        """The runtime's IR of this order (the same actions, as shared :class:`Action` values)."""
        m = self.n_microbatches
        actions = []
        for c in self.codes:
            sm, slot = np.divmod(c, 4)
            st, mb = np.divmod(sm, m)
            make = _MAKE
            actions.append([make[k](s, b) for k, s, b in zip(slot.tolist(), st.tolist(), mb.tolist())])
        sched = PipelineSchedule(self.name, m, tuple(self.stage_to_rank), actions, self.split_backward)
        if self.n_virtual is not None:
            sched.meta["n_virtual"] = self.n_virtual
        return sched


def codes(stage, mb, slot: int, m: int) -> np.ndarray:
    """Codes of ``slot`` actions of ``stage`` (scalar or array) for micro-batches ``mb`` (array)."""
    return (np.asarray(stage, dtype=np.int64) * m + np.asarray(mb, dtype=np.int64)) * 4 + slot


def interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a0 b0 a1 b1 ... of two arrays of one length."""
    out = np.empty(2 * len(a), dtype=np.int64)
    out[0::2], out[1::2] = a, b
    return out


def gpipe_order(p: int, m: int) -> list[np.ndarray]:
    mbs = np.arange(m, dtype=np.int64)
    return [np.concatenate([codes(r, mbs, SLOT_F, m), codes(r, mbs, SLOT_B, m)]) for r in range(p)]


def one_f_one_b_order(p: int, m: int) -> list[np.ndarray]:
    out = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        f = codes(r, np.arange(m, dtype=np.int64), SLOT_F, m)
        b = codes(r, np.arange(m, dtype=np.int64), SLOT_B, m)
        out.append(np.concatenate([f[:warm], interleave(f[warm:], b[:m - warm]), b[m - warm:]]))
    return out


def interleaved_order(p: int, m: int, v: int) -> list[np.ndarray]:
    """Megatron's interleaved 1F1B (see ``generators.interleaved_1f1b``)."""
    total = m * v
    k = np.arange(total, dtype=np.int64)
    chunk_f = (k // p) % v
    chunk_b = v - 1 - chunk_f
    mb = (k // (p * v)) * p + k % p
    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        f = codes(chunk_f * p + r, mb, SLOT_F, m)
        b = codes(chunk_b * p + r, mb, SLOT_B, m)
        out.append(np.concatenate([f[:warm], interleave(f[warm:], b[:total - warm]), b[total - warm:]]))
    return out


def as_arrays(orders: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(o, dtype=np.int64) for o in orders)


def peak_inflight(order: ComputeOrder) -> list[int]:
    """Per rank, ``schedule_ir.peak_inflight`` of its program: a forward opens a chunk, its last
    backward piece (B, or W when dx/dw are split) closes it."""
    out = []
    for r in range(order.n_ranks):
        slot = order.slots(r)
        step = (slot == SLOT_F).astype(np.int64) - ((slot == SLOT_B) | (slot == SLOT_W))
        out.append(max(0, int(np.cumsum(step).max())) if len(step) else 0)
    return out
