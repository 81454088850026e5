"""Mixed precision as priced (bf16 params/compute, fp32 gradient reduction, fp32 master weights)
applied on gloo ranks through FSDP2's MixedPrecisionPolicy, against a bf16 one-device run.

Tolerances: both sides compute every op in bf16 (8-bit mantissa, unit roundoff 2^-9 = 0.2 %);
they differ in where sums are rounded (each rank's half/quarter of the batch is rounded to bf16
before the fp32 reduction, the one-device run rounds the whole-batch sum once), and the
difference compounds through the layers of the backward. A gradient entry may therefore differ
by a few bf16 ulps of the gradient's scale: we allow 3 % of each gradient's largest entry, and
1 % on the loss. That the policy is the priced one is checked exactly: fp32 master weights and
fp32 (reduce-dtype) gradients on every rank.
"""
import math

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.parallelisms.data import fsdp_kwargs, mixed_precision_policy
from hyper_parallel.core.dtensor import fsdp_shard_placement
from tests.planner import e2e_workers, mp_workers

MP = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
CASES = [("llama", (2,), ("dp",)), ("llama", (4,), ("dp",)), ("llama", (2, 2), ("dp", "tp"))]


def _plan(model_name, shape, names):
    import torch

    model = e2e_workers.build(model_name, device="meta")
    plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(4, 16), dtype=torch.float32, fsdp=True,
                    allow_replicated_units=len(shape) == 1)
    assert plan.fsdp["enabled"]
    return plan.replace(fsdp=dict(plan.fsdp, mixed_precision=MP))


def test_policy_from_plan():
    import torch

    pol = mixed_precision_policy({"enabled": True, "mixed_precision": MP})
    assert pol.param_dtype == torch.bfloat16 and pol.reduce_dtype == torch.float32
    # no policy without mixed precision; packed weights always sharded on their other dimension
    assert fsdp_kwargs({"enabled": True}) == {"shard_placement_fn": fsdp_shard_placement}
    assert fsdp_kwargs({"enabled": True, "mixed_precision": MP})["mp_policy"].param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="param_dtype"):
        mixed_precision_policy({"mixed_precision": {"param_dtype": "bf17"}})


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_precision_equals_bf16_one_device(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for model_name, shape, names in [c for c in CASES if math.prod(c[1]) == world]:
        plan = _plan(model_name, shape, names)
        for rank, r in enumerate(pool.run(mp_workers.run_mp_case, plan.to_json(), model_name)):
            where = f"{model_name} {dict(zip(names, shape))} rank {rank}"
            assert r["master_dtypes"] == ["torch.float32"], f"{where}: master weights {r['master_dtypes']}"
            assert r["grad_dtypes"] == ["torch.float32"], f"{where}: gradients {r['grad_dtypes']}"
            assert r["missing"] == []
            assert abs(r["par"] - r["ref"]) <= 1e-2 * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
            assert r["worst_grad"] <= 3e-2, f"{where}: {r['worst_name']} off by {r['worst_grad']:.3g}"
