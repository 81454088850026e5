"""The process group, device and mesh of a run, from torchrun's environment.

Under ``torchrun`` the rank, world size and rendezvous come from the environment it sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). A plain ``python`` call becomes a
world of one (a local TCP store), so the same program runs on a laptop. The backend follows the
device (nccl / hccl / gloo: ``hyper_parallel.platform``).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from autoplan.train.errors import TrainConfigError
from hyper_parallel.local import free_port
from hyper_parallel.platform import backend_for, device_type


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Start the default process group if needed; returns this rank's device."""
    dev = device_type()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if _restarted_under_agent_store():
            dist.init_process_group(backend_for(dev), store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        elif "RANK" in os.environ:   # torchrun (or a launcher like it) set the rendezvous
            dist.init_process_group(backend_for(dev), timeout=timeout)
        else:   # a world of one, without writing the rendezvous into the caller's environment
            dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
    if dev == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, dev).set_device(local)
    return torch.device(dev, local)


def _restarted_under_agent_store() -> bool:
    return ("RANK" in os.environ and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)


def _attempt_store(timeout: timedelta):
    """The torchrun agent's store under a prefix of this restart attempt.

    Why: torchrun (2.13) restarts workers against the same agent TCPStore without a per-attempt
    prefix (torch/distributed/rendezvous.py: "We create a new TCPStore for every retry so no need
    to add prefix" -- but the server is the agent's and keeps the dead attempt's keys). gloo then
    reads the dead ranks' addresses and fails with "Gloo connectFullMesh failed ... Connection
    refused" (measured: --max-restarts 1, 4 gloo ranks, one killed). A prefix per attempt gives
    every attempt fresh keys, so ``torchrun --max-restarts N`` restarts a job by itself."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"autoplan/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def plan_mesh(plan, device: torch.device):
    """The DeviceMesh a plan was made for, on this world; a typed error when the world differs."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise TrainConfigError(
            f"train: the plan is for {math.prod(shape)} ranks (mesh {dict(zip(names, shape))}), this run has "
            f"{world}; start it with `autoplan launch PLAN` (it prints the torchrun command) or plan for {world}")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)
