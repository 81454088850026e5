"""verify's dry run holds ZeRO-1, selective-recompute and mixed-precision plans to their
predicted collectives and parameter bytes exactly, at world sizes no test machine has."""
import pytest
import torch

from autoplan.models import build_llama
from autoplan.verify import verify
from tests.planner.modes_plans import mode_plan


def _llama():
    return build_llama(device="meta", dim=256, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden=520,
                       max_seq_len=256)


CASES = [  # (id, mesh shape, names, batch, plan options)
    ("zero1_dp4_tp2_sp", (4, 2), ("dp", "tp"), (8, 128), dict(dp_mode="zero1", sequence_parallel=True)),
    ("zero1_dp3_uneven", (3,), ("dp",), (6, 64), dict(dp_mode="zero1")),
    ("selective_dp2_tp4_fsdp", (2, 4), ("dp", "tp"), (4, 128), dict(dp_mode="fsdp", recompute="selective")),
    ("zero1_selective_bf16_dp8_tp8", (8, 8), ("dp", "tp"), (16, 128),
     dict(dp_mode="zero1", recompute="selective", dtype=torch.bfloat16)),
    ("mixed_precision_fsdp_dp4_tp2", (4, 2), ("dp", "tp"), (8, 128),
     dict(dp_mode="fsdp", dtype=torch.bfloat16, mixed_precision=True)),
]


@pytest.mark.parametrize("name,shape,names,batch,opts", CASES, ids=[c[0] for c in CASES])
def test_modes_predicted_equals_issued(name, shape, names, batch, opts):
    model = _llama()
    plan = mode_plan(model, shape, names, batch, **opts)
    if opts.get("mixed_precision"):
        assert plan.fsdp["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    result = verify(plan, model)
    assert result.passed, f"{name}: {result.param_bytes}\n{result.mismatches().to_string()}"
    kinds = set(result.collectives[result.collectives["mesh_dim"] == "dp"]["kind"])
    if opts.get("dp_mode") == "zero1":
        assert kinds == {"reduce_scatter", "all_gather"}, kinds


def test_zero1_wrong_bytes_are_caught():
    model = _llama()
    plan = mode_plan(model, (4,), ("dp",), (8, 64), dp_mode="zero1")
    rows = [dict(r) for r in plan.predictions["collectives"]]
    row = next(r for r in rows if r["kind"] == "reduce_scatter")
    row["bytes"] //= 2   # as if the gradients were reduced in the parameters' 16 bits
    plan = plan.replace(predictions=dict(plan.predictions, collectives=rows))
    assert not verify(plan, model).passed


@pytest.mark.parametrize("cons", [dict(dp=2, pp=2, tp=2, dp_mode="zero1", recompute="selective", schedule="1F1B"),
                                  dict(dp=4, pp=1, tp=2, dp_mode="fsdp", recompute="selective", microbatches=1)],
                         ids=["pipelined_zero1_selective", "cluster_fsdp_mixed_precision"])
def test_plan_cluster_modes_verify(cons):
    """plan_cluster writes the modes its search chose (plan_modes) and verify agrees exactly."""
    from autoplan.cluster import plan_cluster

    model = _llama()
    plan = plan_cluster(model, 8, hardware="h100_sxm", batch=(8, 128), constraints=cons,
                        allow_replicated_units=False, sequence_parallel=False)
    assert plan.recompute_mode == "selective" and plan.fsdp["mode"] == cons["dp_mode"]
    if cons["dp_mode"] == "fsdp":
        assert plan.fsdp["mixed_precision"]["reduce_dtype"] == "float32"
    result = verify(plan, model)
    assert result.passed, result.mismatches().to_string()
