"""How much of each collective kind's time compute hides, per data-parallel mode.

Stated per kind, not one constant, because the runtimes differ in *when* they issue it:

- tensor-parallel collectives sit between the GEMMs that produce and consume them (no async TP
  in hyper_parallel): fully exposed, on the critical path of every micro-batch;
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
