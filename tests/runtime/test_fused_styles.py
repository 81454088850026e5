"""Fused q/k/v projections (interleaved per head, and [q|k|v] with packed=3), attention that cuts
by its stored head counts (PrepareHeadsInput) and transformers' Conv1D (transposed weight)
sharded column/row-wise: two steps equal one device on 4 gloo ranks."""
import pytest
import torch.nn as nn

from hyper_parallel import ColwiseParallel, RowwiseParallel
from hyper_parallel.core.tensor_parallel.linear_styles import is_conv1d, linear_features
from tests.runtime import fused_workers

CASES = [("interleaved", False), ("interleaved", True), ("concat", False), ("concat", True), ("counted", False),
         ("counted", True)]


def test_fused_and_conv1d_match_one_device(pool4):
    reports = pool4.run(fused_workers.check_fused, CASES)
    for rank, rep in enumerate(reports):
        assert len(rep) == len(CASES)
        for case, (ok, ref, par, bad, missing) in rep.items():
            assert ok, f"rank {rank} {case}: ref {ref} par {par} grads {bad} missing {missing}"


def test_fsdp_over_a_packed_weight_shards_its_other_dimension(pool4):
    for rank, rep in enumerate(pool4.run(fused_workers.check_fsdp_over_packed)):
        assert rep["ok"], (rank, rep)
        assert rep["placements"]["attn.qkv.weight"] == ("S(1)", "_S(0, 3)"), rep  # dp: dim 1; tp: strided rows
        assert "only dimension" in rep["refused"] and "bias" in rep["refused"], rep


def test_conv1d_is_recognised_with_transposed_features():
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(12, 4)                      # nf=12 out, nx=4 in: weight [4, 12]
    assert is_conv1d(conv) and not is_conv1d(nn.Linear(4, 12))
    assert linear_features(conv) == (4, 12)
    assert ColwiseParallel()._weight_placement("conv1d")["weight"].dim == 1
    assert RowwiseParallel()._weight_placement("conv1d")["weight"].dim == 0
