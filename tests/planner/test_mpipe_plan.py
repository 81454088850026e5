"""MPipe inside plans: autoplan prices the VL model's captured vision tower (stage 0, own
stages, MPipe on the schedule IR), records the choice and the alternatives in ``pipeline.preprocess``,
writes every rank's MPipe collectives; plan.apply runs it on 4 gloo ranks equal to one device (loss
rtol 1e-5, grads rtol 1e-4 / atol 1e-6, tower grads included) and verify's dry run matches exactly."""
import copy
import functools

import pytest
import torch

from autoplan import autoplan
from autoplan.errors import PlanSchemaError
from autoplan.models.vision_language import build_vision_language
from autoplan.plan.pipeline_runner import plan_preprocess
from autoplan.plan.plan import Plan
from autoplan.verify import verify
from hyper_parallel.errors import PipelineError
from tests.planner.mpipe_plan_workers import heavy_vl, run_mpipe_plan


@functools.lru_cache(maxsize=None)
def _plan(pp: int, tp: int, dp: int = 1) -> Plan:
    extra = {"dp_mode": "fsdp"} if dp > 1 else {}
    return autoplan(heavy_vl(), 4, batch=(8 * dp, 12), dtype=torch.float32, devices_per_node=4,
                    constraints={"pp": pp, "tp": tp, "dp": dp, "schedule": "1F1B", "microbatches": 4, **extra},
                    microbatch_sizes=(2,))


@pytest.mark.parametrize("pp,tp", [(4, 1), (2, 2)])
def test_heavy_tower_planned_with_mpipe(pp, tp):
    plan = _plan(pp, tp)
    pre = plan.pipeline["preprocess"]
    assert pre["module"] == "visual" and pre["inputs"] == ["pixel_values"] and pre["placement"] == "mpipe"
    placements = [c["placement"] for c in pre["choices"]]
    assert sorted(placements) == ["mpipe", "own_stage", "stage0"] and placements[0] == "mpipe"
    assert pre["choices"][0]["step_s"] < min(c["step_s"] for c in pre["choices"][1:])
    assert any("vision tower 'visual'" in n for n in plan.notes)
    # every non-stage-0 rank owns micro-batches: it sends tower outputs and the tower all-reduce is on every rank
    big = [r for r in plan.pipeline["rank_collectives"][1] if r["kind"] == "all_reduce" and r["bytes"] > 56]
    assert len(big) == 1
    loaded = Plan.from_json(plan.to_json())   # loading checks, runs nothing
    assert loaded.pipeline["preprocess"] == pre


def test_light_tower_on_cpu_profile_keeps_the_runnable_placement_and_says_what_is_faster():
    """On the cpu profile a light tower is priced faster on stage 0, which has no runtime yet: the plan
    places it with MPipe (it must apply) and its notes say so; a hand-edited stage0 entry is refused."""
    model = build_vision_language(n_layers=4, n_patches=8)
    plan = autoplan(model, 4, batch=(8, 12), hardware="cpu", devices_per_node=4,
                    constraints={"pp": 4, "tp": 1, "dp": 1, "schedule": "1F1B", "microbatches": 4},
                    microbatch_sizes=(2,))
    pre = plan.pipeline["preprocess"]
    assert pre["placement"] == "mpipe" and pre["choices"][0]["placement"] != "mpipe"
    assert any("has no runtime yet" in n for n in plan.notes), plan.notes
    with pytest.raises(PipelineError, match="priced only"):
        plan_preprocess(dict(pre, placement=pre["choices"][0]["placement"]), model, None)


def test_preprocess_entry_checked():
    plan = _plan(4, 1)
    for bad, msg in [({"placement": "tower0"}, "placement"), ({"into": "pixel_values"}, "into"),
                     ({"inputs": []}, "inputs"), ({"extra": 1}, "extra")]:
        js = copy.deepcopy(plan.to_dict())
        js["parallel"]["pp"]["preprocess"].update(bad)
        with pytest.raises(PlanSchemaError, match=msg):
            Plan.from_dict(js)


@pytest.mark.parametrize("pp,tp,dp", [(4, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_mpipe_plan_applies_equal_to_one_device(pool4, pp, tp, dp):
    """dp=2: FSDP on the decoder stages, the tower's summed gradients averaged over dp."""
    plan = _plan(pp, tp, dp)
    assert plan.pipeline["preprocess"]["placement"] == "mpipe"
    js = plan.to_json()
    for rank, r in enumerate(pool4.run(run_mpipe_plan, js, batch=8 * dp)):
        assert r["n_params"] > 0 and r["n_tower"] > 0, (rank, r)
        assert r["loss_err"] < 1e-5, (rank, r)
        assert r["grad_err"] < 1e-4 and r["tower_err"] < 1e-4, (rank, r)


@pytest.mark.parametrize("pp,tp,dp", [(4, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_verify_mpipe_plan_exactly(pp, tp, dp):
    """dp=2 (FSDP): the tower's dp average is one more all-reduce of the same bytes on dp."""
    plan, model = _plan(pp, tp, dp), heavy_vl()
    res = verify(plan, model)
    assert res.passed, res.mismatches()
    # every pipeline rank holds the whole tower (after its TP; a replica over dp): its bytes are in each
    # rank's predicted parameter bytes, which the dry run's issued bytes equal (they were missing)
    tower = sum(p.numel() * 4 for p in model.get_submodule(plan.pipeline["preprocess"]["module"]).parameters()) // tp
    assert all(b >= tower for b in plan.pipeline["rank_param_bytes"]), (tower, plan.pipeline["rank_param_bytes"])
    df = res.collectives
    assert set(df["pp_rank"]) == set(range(pp))
    # the tower-gradient all-reduce (the largest all-reduce) is predicted and issued on every rank
    ar = df[(df.kind == "all_reduce") & (df.bytes > 56)]
    assert len(ar) == pp * (2 if dp > 1 else 1) and (ar["predicted"] == 1).all() and (ar["issued"] == 1).all()
    # the transposed tower output (2 sequences x 8 patches x 32 fp32 = 2048 B): stage 0's rank receives
    # the micro-batches other ranks own (4 micro-batches, front placement) and sends their gradients back
    tr = df[(df.pp_rank == 0) & (df.kind == "send_recv") & (df.bytes == 2048)]
    owned_elsewhere = sum(1 for mb in range(4) if mb % pp != 0)
    assert int(tr["issued"].iloc[0]) == int(tr["predicted"].iloc[0]) == 2 * owned_elsewhere
