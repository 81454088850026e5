"""Planning inside a launched job gives exactly the plan planning outside gives.

The planner checks its sharded strategies on a fake process group; inside a job (after
``init_process_group``) that group now starts in a c10d world of its own
(``hyper_parallel.local.isolated_world``). Before, every sharded option was rejected there and the
plan came back replicated, or was refused for memory. Checked here:

- one torchrun launch of 4 gloo ranks (~1 min on this machine): the repo Llama, an HF Llama and
  Qwen3 on live dp=2 x tp=2 and tp=4 meshes plan byte-identically to offline planning in this
  process, on every rank; no collective is issued on any of the job's groups while planning
  (gloo's per-group sequence numbers, and rank 0 planning one case more than the others without
  hanging); the job's groups and a DTensor redistribute work afterwards, with the right values;
- inside a fake process group of 64 ranks in this process, the Mistral-7B (dp8 x tp8) and
  Llama-3-70B (dp64 x tp8) shapes get their offline plans (Megatron styles; 70B fits);
- where isolation cannot work, planning raises StrategyCheckError naming why and what to do.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from autoplan import autoplan
from autoplan.errors import StrategyCheckError
from autoplan.presets import build_preset
from hyper_parallel.local import fake_world
from hyper_parallel.parallel_dims import ParallelDims
from tests.planner import plan_in_job_workers as workers

ROOT = Path(__file__).resolve().parents[2]
# a plan carries no wall-clock field today (its *_s fields are predictions); any added later is
# allowed to differ between two plannings
_TIMING_KEYS = ("seconds", "wall_s", "elapsed", "planning_time")


def _stable(plan_json: str) -> str:
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if not any(t in k for t in _TIMING_KEYS)}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o
    return json.dumps(strip(json.loads(plan_json)), sort_keys=True)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_in_job")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
            "tests.planner.plan_in_job_workers", str(out)]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_plans_in_a_torchrun_job_equal_offline_plans_and_the_job_groups_still_work(job):
    assert not dist.is_initialized()   # offline: no process group in this process
    offline = {f"{model}/{mesh}": workers.plan_case(model, workers.offline_mesh(mesh))
               for model, mesh in workers.CASES}
    offline["rank0_extra"] = offline["/".join(workers.RANK0_EXTRA)]
    for key, plan_json in offline.items():
        assert json.loads(plan_json)["parallel"]["tp"]["styles"], f"{key}: offline plan has no styles"
    for rank, got in enumerate(job):
        expected = {k: v for k, v in offline.items() if rank == 0 or k != "rank0_extra"}
        assert got["plans"].keys() == expected.keys()
        for key, plan_json in expected.items():
            assert _stable(got["plans"][key]) == _stable(plan_json), f"rank {rank}, {key}"
        assert got["seq_after"] == got["seq_before"], f"rank {rank}: collectives on the job's groups while planning"
        assert got["same_groups"], f"rank {rank}: the job's group names no longer resolve to its groups"
        assert got["world_sum"] == 10.0 and got["redistributed"], got
        assert got["tp_sum"] == sum(r + 1 for r in got["tp_ranks"]), got


SHAPES = [("mistral-7b", (8, 8), (64, 4096)), ("llama3-70b", (64, 8), (512, 8192))]


@pytest.mark.parametrize("name,shape,batch", SHAPES, ids=[s[0] for s in SHAPES])
def test_real_shapes_plan_the_same_inside_a_fake_world_of_64(name, shape, batch):
    def plan():
        model = build_preset(name, dtype=torch.bfloat16)
        return autoplan(model, ParallelDims(shape, ("dp", "tp"), "h100_sxm"), batch=batch)

    with fake_world(64):   # the process's default group: a job of 64 ranks
        inside = plan()
        assert dist.get_world_size() == 64
    offline = plan()
    assert inside.to_json() == offline.to_json()
    styles = {fqn: s["style"] for fqn, s in offline.styles.items()}
    # Megatron: q/k/v and the MLP's input projections column-wise, their outputs row-wise
    assert styles.get("model.layers.*.self_attn.q_proj") == "ColwiseParallel", styles
    assert styles.get("model.layers.*.self_attn.o_proj") == "RowwiseParallel", styles
    assert styles.get("model.layers.*.mlp.down_proj") == "RowwiseParallel", styles


class _ThreadLocalWorld:
    """Stands in for a c10d world that is not torch's ``_World`` (torch's threaded test backend
    installs one whose maps differ per thread)."""
    default_pg = None
    pg_names: dict = {}


def test_planning_refuses_with_the_reason_where_the_check_cannot_be_isolated(monkeypatch):
    monkeypatch.setattr(c10d, "_world", _ThreadLocalWorld())
    with pytest.raises(StrategyCheckError, match=r"tp=2 .*_ThreadLocalWorld.*separate process"):
        autoplan(workers.repo_llama(), ParallelDims((2,), ("tp",), "h100_sxm"), batch=(16, 4096))
