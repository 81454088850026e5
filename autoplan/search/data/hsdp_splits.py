"""HSDP: data parallel as dp_replicate x dp_shard -- the node-aligned splits and the replicate
all-reduces FSDP2 adds (``autoplan.hsdp`` prices them)."""
from __future__ import annotations

from typing import Sequence

from autoplan.errors import PlanningError
from autoplan.search.mesh.candidates import divisors
from autoplan.search.tp.search import exposed_dp
from cost_models.topology import mesh_topology
from hyper_parallel.core.collective import Collective
from hyper_parallel.parallel_dims import ParallelDims

# ---- HSDP: data parallel as dp_replicate x dp_shard ------------------------------------------
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"


def hsdp_splits(dp: int, inner: int, devices_per_node: int) -> list[tuple[int, int]]:
    """(replicate, shard) splits of ``dp`` data-parallel ranks whose shard groups respect node
    boundaries: one dp_shard group spans ``shard * inner`` consecutive ranks (``inner``: the
    ranks of the dims after dp, e.g. tp), and it must either fit in one node (dividing it) or
    cover whole nodes -- a group straddling a node edge pays inter-node bandwidth for FSDP's
    every-layer all-gathers without the memory of a whole extra node. Shard >= 2 (shard 1 is
    replicated data parallel)."""
    if dp < 1 or inner < 1 or devices_per_node < 1:
        raise PlanningError(f"hsdp_splits: dp={dp}, inner={inner}, devices_per_node={devices_per_node} "
                            "must all be >= 1")
    out = []
    for shard in divisors(dp):
        span = shard * inner
        if shard >= 2 and (span % devices_per_node == 0 or devices_per_node % span == 0):
            out.append((dp // shard, shard))
    return out


def hsdp_replicate_rows(fsdp_rows: Sequence[dict], shard: int, replicate: int, shard_dim: str = DP_SHARD
                        ) -> list[dict]:
    """The all-reduces FSDP2's HSDP adds over dp_replicate: one per reduce-scatter over the shard
    dimension (``shard_dim``), of the reduce-scattered gradient (the padded unit bytes / shard),
    in backward."""
    if replicate <= 1:
        return []
    return [Collective("all_reduce", "backward", int(r["bytes"]) // shard, int(r["count"]), DP_REPLICATE).to_row()
            for r in fsdp_rows if r["kind"] == "reduce_scatter" and r["mesh_dim"] == shard_dim]


def hsdp_replicate_time(fsdp_rows: Sequence[dict], replicate_rows: Sequence[dict], spec: ParallelDims,
                        compute_s: float, shard_dim: str = DP_SHARD) -> float:
    """Seconds the dp_replicate all-reduces add to a step: their alpha-beta time on ``spec``'s
    links, exposed by the same overlap rule the TP planner applies to FSDP traffic
    (``exposed_dp``): what the FSDP rows over the shard dimension plus these expose, minus what
    the FSDP rows alone expose."""
    topo = mesh_topology(spec)

    def seconds(rows):
        return sum(r["count"] * topo.collective_time(r["mesh_dim"], r["kind"], r["bytes"]) for r in rows)

    shard_s = seconds([r for r in fsdp_rows if r["mesh_dim"] == shard_dim])
    return exposed_dp(shard_s + seconds(replicate_rows), compute_s) - exposed_dp(shard_s, compute_s)
