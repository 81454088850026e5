"""Uneven tensor-parallel shards: a vocabulary of 130 and an MLP hidden size of 90 at
tp=4 -- real sizes rarely divide (128257 tokens, 14336 hidden at tp=3). DTensor cuts 130 rows in
chunks of 33 (33, 33, 33, 31); the styles annotate each input with its whole width, the planner
prices the fullest rank and says which units are uneven, verify's dry run matches the padded
gathers exactly, and one training step on 4 gloo ranks equals one device."""
import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.models.llama_plans import EXPERT_PLANS
from autoplan.verify import verify
from tests.planner import e2e_workers

CASES = [("llama_uneven", True), ("llama_uneven", False), ("hf_llama_uneven", True), ("hf_llama_uneven", False)]


def _plan(name, sp, **kw):
    model = e2e_workers.build(name, device="meta")
    return autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 16), dtype=torch.float32,
                    allow_replicated_units=False, sequence_parallel=sp, **kw)


@pytest.fixture(scope="module")
def plans():
    out = {(n, sp): _plan(n, sp) for n, sp in CASES}
    # loss parallel on the uneven vocabulary: torchtitan's plan priced on the repo model
    out[("llama_uneven", "torchtitan")] = _plan("llama_uneven", True, styles=EXPERT_PLANS["torchtitan"]())
    return out


def test_the_plan_says_which_units_are_uneven(plans):
    for key, plan in plans.items():
        uneven = [d for d in plan.decisions if d.get("uneven")]
        assert {d["unit"].split("/")[-1] for d in uneven} >= {"mlp", "embedding", "head"}, key
        assert any("uneven shards, vocabulary 130 over tp=4: 33 on the fullest rank" in n for n in plan.notes), key
        assert any("MLP hidden 90 over tp=4: 23 on the fullest rank" in n for n in plan.notes), key
    assert plans[("llama_uneven", "torchtitan")].loss_parallel


def test_uneven_plans_verify_exactly(plans):
    for (name, _), plan in plans.items():
        res = verify(plan, e2e_workers.build(name, device="meta"))
        assert res.passed, (name, res.error, res.mismatches(), res.param_bytes)


def test_uneven_plans_equal_one_device_on_4_ranks(plans, pool4):
    for (name, variant), plan in plans.items():
        for rank, r in enumerate(pool4.run(e2e_workers.run_case, plan.to_json(), name)):
            where = f"{name} {variant} rank {rank} stream {plan.stream_layout} loss_parallel {plan.loss_parallel}"
            assert r["par"] == pytest.approx(r["ref"], rel=1e-5), where
            assert not r["bad_grads"] and not r["bad_params"], (where, r)

