"""ZeRO-1 and selective recomputation applied on gloo ranks equal one device (fp32: the e2e
tolerances, rtol 1e-4 -- the only difference is the order of the dp sum), and the selective
policy really stops saving the attention core. Under ZeRO-1 no rank holds the whole averaged
gradients, so its check is the parameters after the step and the rank's reduced slice."""
import math

import pytest
import torch

from tests.planner import e2e_workers, modes_workers
from tests.planner.modes_plans import mode_plan

# (model, mesh shape, names, dp mode, recompute, planner options)
CASES = [
    ("llama", (2,), ("dp",), "zero1", "none", {}),
    ("hf_llama", (2,), ("tp",), "replicate", "selective", dict(allow_replicated_units=False)),
    ("llama_tied", (2,), ("dp",), "zero1", "selective", {}),
    ("llama", (4,), ("dp",), "zero1", "selective", {}),
    ("hf_llama", (2, 2), ("dp", "tp"), "zero1", "selective", dict(allow_replicated_units=False,
                                                                  sequence_parallel=True)),
    ("llama", (2, 2), ("dp", "tp"), "fsdp", "selective", dict(allow_replicated_units=False)),
]


@pytest.mark.parametrize("world", [2, 4])
def test_modes_equal_one_device(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for model_name, shape, names, mode, rc, opts in [c for c in CASES if math.prod(c[1]) == world]:
        model = e2e_workers.build(model_name, device="meta")
        plan = mode_plan(model, shape, names, (4, 16), dp_mode=mode, recompute=rc, **opts)
        assert plan.recompute_mode == rc
        if mode == "zero1":
            assert {r["kind"] for r in plan.predictions["collectives"] if r["mesh_dim"] == "dp"} == \
                {"reduce_scatter", "all_gather"}
        fn = modes_workers.run_zero1_case if mode == "zero1" else e2e_workers.run_case
        for rank, r in enumerate(pool.run(fn, plan.to_json(), model_name)):
            where = f"{model_name} {dict(zip(names, shape))} {mode} {rc} rank {rank}"
            assert abs(r["par"] - r["ref"]) <= 1e-5 * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
            assert r["bad_grads"] == [], f"{where}: grads differ {r['bad_grads']}"
            assert r["bad_params"] == [], f"{where}: params after step differ {r['bad_params']}"
            if mode == "zero1":
                assert r["grad_slice_ok"], f"{where}: reduced gradient slice differs from one device"


def _saved_bytes(model, tokens) -> tuple[int, torch.Tensor]:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).logits.float().pow(2).mean() if hasattr(model(tokens), "logits") else \
            model(tokens).float().pow(2).mean()
    loss.backward()
    return total[0], loss.detach()


@pytest.mark.parametrize("model_name", ["llama", "hf_llama"])
def test_selective_recompute_saves_less_and_changes_nothing(model_name):
    from autoplan.parallelisms.recompute import recompute_attention_core

    ref, sel = e2e_workers.build(model_name), e2e_workers.build(model_name)
    plan = mode_plan(e2e_workers.build(model_name, device="meta"), (1,), ("dp",), (2, 32), recompute="selective")
    wrapped = recompute_attention_core(sel, plan.recompute["modules"])
    assert len(wrapped) == 2
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    b_ref, l_ref = _saved_bytes(ref, tokens)
    b_sel, l_sel = _saved_bytes(sel, tokens)
    assert torch.equal(l_ref, l_sel)
    for (n, p), (_, q) in zip(ref.named_parameters(), sel.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert b_sel < b_ref, (b_sel, b_ref)


def test_selective_pattern_for_another_model_fails():
    from autoplan.errors import PlanSchemaError
    from autoplan.parallelisms.recompute import recompute_attention_core

    with pytest.raises(PlanSchemaError, match="matches no module"):
        recompute_attention_core(e2e_workers.build("llama"), ["model.layers.*.self_attn"])
