"""DenseExpertsParallel (Llama-4's experts, every expert on pre-scaled token copies) split over
tp=2: output, input gradient and every weight gradient equal one device."""
import pytest
import torch

from hyper_parallel.core.expert_parallel import DenseExpertsParallel
from hyper_parallel.errors import DivisibilityError, UnsupportedModuleError
from hyper_parallel.local import fake_world
from tests.runtime import dense_experts_workers
from torch.distributed.device_mesh import init_device_mesh


def test_dense_experts_split_over_tp_equal_one_device(pool2):
    for r in pool2.run(dense_experts_workers.dense_experts_match_one_device):
        assert r["out"] and r["input_grad"] and all(r["grads"].values()), r
        assert r["local_shapes"] == {"gate_up_proj": (4, 8, 12), "down_proj": (4, 6, 8)}


def test_dense_experts_refuses_what_it_cannot_split():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(DivisibilityError, match="ffn width"):
            DenseExpertsParallel().check_module(dense_experts_workers.DenseExperts(ffn=6), mesh, "experts")
        with pytest.raises(UnsupportedModuleError, match="gate_up_proj"):
            DenseExpertsParallel().check_module(torch.nn.Linear(4, 4), mesh, "experts")
