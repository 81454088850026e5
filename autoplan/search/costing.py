"""Prices of strategies: compute (roofline on the hardware profile), collectives (alpha-beta per
mesh dimension from cost_models), and per-rank memory (parameters, gradients, AdamW state,
saved activations). One place, so the ILP and the plan's predictions never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

from autoplan.search.strategies import Collective
from autoplan.search.structure import Work


@dataclass
class CostContext:
    hardware: object            # cost_models HardwareProfile
    topology: object            # cost_models MeshTopology
    dtype: str                  # compute dtype, e.g. "bf16"
    tp_dim: str
    dp_dim: str | None
    dp: int
    fsdp: bool
    param_bytes_per_element: int
    optimizer_bytes_per_element: int   # AdamW: 2 fp32 states (+ fp32 master weights for 16-bit params)
    checkpoint_blocks: bool = False    # full activation checkpointing of every repeated block

    def compute_time(self, work: Work, shard: int) -> float:
        hw = self.hardware
        eff = hw.efficiency
        t_flop = work.flops / shard / (hw.peak(self.dtype) * eff.compute)
        t_mem = work.bytes / shard / (hw.memory_bandwidth * eff.memory)
        return max(t_flop, t_mem) + work.kernels * eff.kernel_overhead

    def collective_time(self, c: Collective) -> float:
        if c.nbytes <= 0:
            return 0.0
        dim = self.tp_dim if c.dim == "tp" else c.dim
        if dim not in self.topology.names or self.topology[dim].size == 1:
            return 0.0
        return c.count * self.topology.collective_time(dim, c.kind, c.nbytes)

    def comm_time(self, collectives: list[Collective]) -> float:
        return sum(self.collective_time(c) for c in collectives)

    def state_bytes(self, param_bytes: float, param_shard: int) -> dict[str, float]:
        """Parameters, gradients and optimizer state per rank for ``param_bytes`` of weights."""
        elements = param_bytes / self.param_bytes_per_element / param_shard
        fsdp = self.dp if self.fsdp else 1
        return {"params": elements * self.param_bytes_per_element / fsdp,
                "grads": elements * self.param_bytes_per_element / fsdp,
                "optimizer": elements * self.optimizer_bytes_per_element / fsdp}

    def fsdp_collectives(self, param_bytes: float, param_shard: int) -> list[Collective]:
        """FSDP over the dp dimension for one wrapped unit: all-gather in forward and again in
        backward (reshard after forward), reduce-scatter of gradients."""
        if not self.fsdp or self.dp <= 1 or param_bytes <= 0:
            return []
        b = int(param_bytes / param_shard)
        return [Collective("all_gather", "forward", b, dim=self.dp_dim),
                Collective("all_gather", "backward", b, dim=self.dp_dim),
                Collective("reduce_scatter", "backward", b, dim=self.dp_dim)]

    def ddp_collectives(self, param_bytes: float, param_shard: int) -> list[Collective]:
        if self.fsdp or self.dp <= 1 or param_bytes <= 0:
            return []
        return [Collective("all_reduce", "backward", int(param_bytes / param_shard), dim=self.dp_dim)]
