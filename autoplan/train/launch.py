"""The torchrun command line a plan needs: how many nodes, ranks per node, and the rendezvous.

A plan fixes the world size (the product of its mesh). Ranks per node default to the plan's
``devices_per_node`` (or its hardware profile's), so the innermost mesh dimension (tp) stays
inside a node, as the planner priced it. One node gets ``--standalone``; several nodes get a c10d
rendezvous at ``--rdzv-endpoint`` (the first node's address) under one job id, and the same
command runs on every node.
"""
from __future__ import annotations

import math
import shlex
from typing import Sequence

from autoplan.train.errors import TrainConfigError
from cost_models.hardware import load_hardware


def _per_node(plan, world: int) -> int:
    n = plan.mesh.get("devices_per_node")
    if not n:
        try:
            n = load_hardware(plan.mesh.get("hardware", "h100_sxm")).devices_per_node
        except Exception:  # noqa: BLE001 - an unknown profile: one node holds the whole world
            n = world
    return max(1, min(int(n), world))


def torchrun_command(plan, *, nproc_per_node: int | None = None, nnodes: int | None = None,
                     rdzv_endpoint: str = "$MASTER_ADDR:29500", job_id: str = "autoplan",
                     train_args: Sequence[str] = (), plan_path: str = "plan.json",
                     python: str | None = None) -> list[str]:
    """argv of the torchrun command that trains ``plan`` (``autoplan train --plan plan_path ...``)."""
    world = math.prod(plan.mesh["shape"])
    if nnodes and not nproc_per_node:
        if world % nnodes:
            raise TrainConfigError(f"launch: --nnodes {nnodes} does not divide the plan's world size {world}")
        nproc_per_node = world // nnodes
    per = nproc_per_node or _per_node(plan, world)
    if per < 1 or world % per:
        raise TrainConfigError(f"launch: --nproc-per-node {per} does not divide the plan's world size {world} "
                               f"(mesh {dict(zip(plan.mesh['names'], plan.mesh['shape']))}); use a divisor of {world}")
    nodes = world // per
    if nnodes and nnodes != nodes:
        raise TrainConfigError(f"launch: --nnodes {nnodes} x --nproc-per-node {per} != world size {world}")
    cmd = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    if nodes == 1:
        cmd += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(per)]
    else:
        cmd += ["--nnodes", str(nodes), "--nproc-per-node", str(per), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", job_id]
    return cmd + ["-m", "autoplan.cli", "train", "--plan", plan_path, *train_args]


def format_command(argv: Sequence[str]) -> str:
    """One shell line; ``$VARS`` stay unquoted so the shell expands them on each node."""
    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)
