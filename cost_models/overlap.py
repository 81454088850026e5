"""How much of each collective kind's time compute hides, per data-parallel mode.

Stated per kind, not one constant, because the runtimes differ in *when* they issue it:

- tensor-parallel collectives sit between the GEMMs that produce and consume them: fully exposed,
  on the critical path of every micro-batch -- unless async TP fuses a sequence-parallel one with
  its matmul (:func:`fused_collective_matmul`);
- pipeline P2P: charged by the schedule simulator as a hop between stages (not here);
- replicated data parallel (``replicate``): ``autoplan.plan.data_parallel.allreduce_gradients``
  all-reduces one flat buffer after backward, as Megatron-LM's 2021 local DDP did: fully exposed;
- ZeRO-1 (``zero1``): gradients reduce-scattered after backward, updated shards all-gathered
  after the optimizer step: both outside backward, fully exposed;
- FSDP (``fsdp``, FSDP2 ``fully_shard``): all-gathers are prefetched one unit ahead and
  reduce-scatters overlap the next unit's backward, so compute hides most of the traffic; the
  first all-gather and the last reduce-scatter of a step cannot be hidden, and copy engines
  contend with compute (``exposed_min`` 0.1, at most 0.8 of compute time usable for hiding).

``exposed = exposed_min * comm + max(0, (1 - exposed_min) * comm - hidden_by_compute * compute)``:
linear in (comm, compute) piecewise, so the TP ILP can carry it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

DP_MODES = ("replicate", "zero1", "fsdp")


@dataclass(frozen=True)
class Overlap:
    exposed_min: float          # share of the traffic that is never hidden
    hidden_by_compute: float    # share of the compute time the rest can hide behind

    def exposed(self, comm: float, compute: float) -> float:
        return self.exposed_min * comm + max(0.0, (1.0 - self.exposed_min) * comm - self.hidden_by_compute * compute)


DP_OVERLAP = {"replicate": Overlap(1.0, 0.0), "zero1": Overlap(1.0, 0.0), "fsdp": Overlap(0.1, 0.8)}
TP_OVERLAP = Overlap(1.0, 0.0)


def dp_overlap(mode: str) -> Overlap:
    try:
        return DP_OVERLAP[mode]
    except KeyError:
        raise ValueError(f"dp_mode={mode!r} is not one of {DP_MODES}") from None


def fused_collective_matmul(comm_s: float, matmul_s: float, chunk_s: float, tp: int) -> float:
    """Seconds a tensor-parallel collective still costs when async TP fuses it with its matmul(s)
    (torch's ``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``), beyond the
    ``matmul_s`` the unfused matmul already costs.

    The fused op cuts the GEMM into one chunk per TP rank (each ``chunk_s``: the GEMM at M / tp,
    priced at that shape's own efficiency) and moves the next rank's chunk over NVLink on a copy
    engine while the current one multiplies (``_pipelined_all_gather_and_consume``: tp - 1 remote
    copies on a side stream, no SMs taken). One chunk's copy is the collective's bandwidth time over
    its tp - 1 steps, so the op takes ``chunk_s + (tp - 1) * max(copy, chunk_s)``: the collective
    hides entirely when a chunk's GEMM outlasts its copy, and the price of hiding is the smaller
    GEMMs' lower efficiency (``tp * chunk_s - matmul_s``)."""
    if tp <= 1:
        return comm_s
    copy = comm_s / (tp - 1)
    return max(0.0, chunk_s + (tp - 1) * max(copy, chunk_s) - matmul_s)
