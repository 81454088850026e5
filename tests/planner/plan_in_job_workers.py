"""The torchrun side of tests/planner/test_plan_in_job.py: plan inside a launched job.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 4 -m
tests.planner.plan_in_job_workers OUT_DIR``. Every rank starts its gloo group, builds the user's
live meshes (dp=2 x tp=2 and tp=4), plans every case of :data:`CASES` with ``autoplan(model,
live_mesh)`` -- rank 0 plans one case more than the others, so a collective hidden in planning
would leave rank 0 waiting for partners that never come (the group timeout is short) -- and then
shows the user's groups still work: an all_reduce on the world and on the tp group, and a DTensor
redistribute on the live 2-D mesh, with their values. It writes ``OUT_DIR/rank<r>.json``: the
plans' JSON, the sequence number of every real group before and after planning (gloo counts every
collective issued on a group), whether the groups' names still resolve to the same groups, and the
checks' values. The test compares the plans with offline planning in its own process.
"""
from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoplan import autoplan
from autoplan.models import build_llama
from hyper_parallel.parallel_dims import ParallelDims
from tests.planner.models import hf_model

log = logging.getLogger(__name__)

HARDWARE = "h100_sxm"
MESHES = {"dp2tp2": ((2, 2), ("dp", "tp")), "tp4": ((4,), ("tp",))}


def repo_llama():
    """The repo Llama at width 1024 (the shape the issue saw planned without styles in a job)."""
    return build_llama(device="meta", dim=1024, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=32000,
                       ffn_hidden=2816, max_seq_len=4096)


def hf_llama():
    return hf_model("llama", device="meta", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)


def hf_qwen3():
    """A non-Llama family whose q/k norms see head-sharded activations: the probe repairs them."""
    return hf_model("qwen3", device="meta", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1024)


MODELS = {"repo_llama": (repo_llama, (16, 4096)), "hf_llama": (hf_llama, (16, 512)), "hf_qwen3": (hf_qwen3, (16, 512))}
CASES = [(model, mesh) for mesh in MESHES for model in MODELS]
RANK0_EXTRA = ("hf_qwen3", "tp4")   # planned a second time on rank 0 only


def plan_case(model: str, mesh) -> str:
    """``autoplan`` of one case on ``mesh`` (a live DeviceMesh here, a ParallelDims offline)."""
    build, batch = MODELS[model]
    return autoplan(build(), mesh, batch=batch, hardware=HARDWARE).to_json()


def offline_mesh(name: str) -> ParallelDims:
    shape, names = MESHES[name]
    return ParallelDims(shape, names, HARDWARE)


def _sequence_numbers() -> dict[str, int]:
    return {name: pg._get_sequence_number_for_group() for pg, name in c10d._world.pg_names.items()}


def main(out: Path) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    meshes = {name: init_device_mesh("cpu", shape, mesh_dim_names=names) for name, (shape, names) in MESHES.items()}
    groups = dict(c10d._world.pg_names)
    before = _sequence_numbers()
    plans = {f"{model}/{mesh}": plan_case(model, meshes[mesh]) for model, mesh in CASES}
    if rank == 0:
        model, mesh = RANK0_EXTRA
        plans["rank0_extra"] = plan_case(model, meshes[mesh])
    after = _sequence_numbers()
    same_groups = dict(c10d._world.pg_names) == groups and all(
        c10d._resolve_process_group(name) is pg for pg, name in groups.items())

    world_sum = torch.tensor([float(rank + 1)])
    dist.all_reduce(world_sum)
    mesh = meshes["dp2tp2"]
    tp_sum = torch.tensor([float(rank + 1)])
    dist.all_reduce(tp_sum, group=mesh.get_group("tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    full = torch.arange(16.0).reshape(4, 4)
    local = full[dp * 2:(dp + 1) * 2, tp * 2:(tp + 1) * 2].clone()
    gathered = DTensor.from_local(local, mesh, [Shard(0), Shard(1)]).redistribute(
        mesh, [Replicate(), Replicate()]).to_local()
    (out / f"rank{rank}.json").write_text(json.dumps({
        "plans": plans, "seq_before": before, "seq_after": after, "same_groups": same_groups,
        "world_sum": world_sum.item(), "tp_sum": tp_sum.item(), "tp_ranks": dist.get_process_group_ranks(
            mesh.get_group("tp")), "redistributed": torch.equal(gathered, full)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
