"""Tensor-parallel numerics: expert plans on 2 and 4 gloo ranks equal one device."""
import pytest

from tests.runtime import tp_workers

PLANS = ["torchtitan", "torchtitan_no_loss_parallel", "megatron", "megatron_loss_parallel"]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_plans_match_one_device(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    reports = pool.run(tp_workers.check_expert_plans, PLANS)
    for rank, rep in enumerate(reports):
        for case, (ok, ref, par, bad, missing) in rep.items():
            assert ok, f"rank {rank} {case}: ref {ref} par {par} grads {bad} missing {missing}"
    assert len(reports[0]) == len(PLANS) * 2
