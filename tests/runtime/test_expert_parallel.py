"""ExpertParallel: MoE experts split over an ep mesh dimension (tokens moved by all-to-all,
optional expert tensor parallelism). One training step equals one device for HF Mixtral,
Qwen3-MoE, DeepSeek-V3 (MLA + shared experts + a dense first layer), GPT-OSS (biases,
transposed interleaved weights) and the repo MoE model (3-D and ModuleList experts) at ep=2,
ep=4, ep=2 x tp=2, dp=2 x ep=2 (4 ranks) and dp=2 x ep=2 x tp=2 (8 ranks); the collectives
it issues under balanced routing equal its prediction at world 8 and 64; bad plans are typed
errors that leave the model as it was; FSDP2 over dp (experts) and dp x ep (the rest) composes
with it."""
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from autoplan.models.moe import build_moe
from hyper_parallel import ExpertParallel, parallelize_module, style_from_dict
from hyper_parallel.core.expert_parallel import balanced_assignment, expert_parallel_collectives, grouped_mm
from hyper_parallel.errors import DivisibilityError, MeshError, StyleSpecError
from hyper_parallel.local import fake_world
from tests.runtime import ep_workers

MODELS4 = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "repo", "repo_list"]
CASES4 = [(m, c) for m in MODELS4 for c in ("ep2", "ep4", "ep2xtp2", "dp2xep2") if (m, c) != ("repo_list", "ep2xtp2")]
CASES4 += [(m, "ep4split") for m in ("mixtral", "deepseek_v3", "repo_list")] + [("mixtral", "ep2xtp2attn")]
# 6 experts over ep=4 (2, 2, 2, 0 per rank: one rank holds none) and 16 routed copies per rank: uneven
# all-to-all splits, every token count routes
CASES4 += [("mixtral:6", "ep4"), ("repo_list:6", "ep4")]
CASES8 = [(m, "dp2xep2xtp2") for m in ("deepseek_v3", "gpt_oss")]


def _check_numerics(reports, cases):
    for rank, rep in enumerate(reports):
        for model, case in cases:
            r = rep[f"{model}/{case}"]
            assert "error" not in r, (rank, model, case, r)
            assert r["loss_ok"] and not r["bad"], (rank, model, case, r)
            assert r["n_sharded"] > 0 and r["n_grads"] > 10, (rank, model, case, r)
            assert r["aux"] == (case == "ep4split" and model in ep_workers.AUX_MODELS), (model, case, r)


def test_one_step_equals_one_device_on_4_ranks(pool4):
    reports = pool4.run(ep_workers.check_all, CASES4)
    _check_numerics(reports, CASES4)
    for rank, rep in enumerate(reports):
        errors = rep["errors"]
        assert "not an experts container" in errors["wrong_module"]["message"] or \
            "has no forward" in errors["wrong_module"]["message"], errors
        assert "needs 3-D expert weights" in errors["list_tp"]["message"], errors
        assert all(e["unchanged"] for e in errors.values()), errors
        for model, r in rep["fsdp"].items():
            assert r["loss_ok"] and not r["bad"], (rank, model, r)
            assert r["expert_mesh_dims"] == [("dp", "ep")], (rank, model, r)
        assert rep["balanced"]["close"] and rep["balanced"]["counts"] == [4] * 8, rep["balanced"]


def test_dp_ep_tp_on_8_ranks(pool8):
    _check_numerics(pool8.run(ep_workers.check_all, CASES8, False), CASES8)


@pytest.mark.parametrize("world,shape,names,tp_dim,experts,split", [
    (8, (2, 2, 2), ("dp", "ep", "tp"), "tp", 8, False),
    (64, (4, 8, 2), ("dp", "ep", "tp"), "tp", 16, False),
    (64, (8, 8), ("dp", "ep"), None, 16, False),
    (64, (8, 4, 2), ("dp", "ep", "tp"), "tp", 8, True),
    (8, (4, 1, 2), ("dp", "ep", "tp"), "tp", 8, False),   # ep = 1: expert TP only, no all-to-all
    (8, (1, 4, 2), ("dp", "ep", "tp"), "tp", 6, False),   # 6 experts over ep=4, 32 copies: uneven rows
])
def test_predicted_collectives_equal_issued_in_a_dry_run(world, shape, names, tp_dim, experts, split):
    issued, predicted = ep_workers.dry_run_collectives(world, shape, names, tp_dim, experts, batch=2, seq=8,
                                                       split_tokens=split)
    assert issued == predicted
    assert any(r["kind"] == "all_gather" for r in issued) == split
    kinds = {(r["kind"], r["mesh_dim"]) for r in issued}
    assert (("all_to_all", "ep") in kinds) == (shape[1] > 1) and (("all_reduce", "tp") in kinds) == (tp_dim is not None)


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_whole_hf_models_dry_run_at_world_64_as_predicted(model):
    issued, predicted = ep_workers.hf_dry_run(model)
    assert issued == predicted and issued


def test_style_is_data():
    for style in (ExpertParallel(), ExpertParallel(tp_dim="tp"), ExpertParallel(ep_dim="e", balanced=True),
                  ExpertParallel(split_tokens=True)):
        assert style_from_dict(style.to_dict()) == style
    assert ExpertParallel(tp_dim="tp").to_dict() == {"style": "ExpertParallel", "args": {"tp_dim": "tp"}}
    with pytest.raises(StyleSpecError, match="unknown argument"):
        style_from_dict({"style": "ExpertParallel", "args": {"ep": 2}})
    with pytest.raises(StyleSpecError, match="tp_dim"):
        ExpertParallel(tp_dim="ep")


def test_grouped_mm_kernel_and_loop_agree():
    g = torch.Generator().manual_seed(0)
    for n_in, n_out, dtype in ((8, 16, torch.float32), (6, 5, torch.float32), (8, 8, torch.float64)):
        counts = [3, 0, 5, 2]
        x = torch.randn(10, n_in, dtype=dtype, generator=g, requires_grad=True)
        w = torch.randn(4, n_in, n_out, dtype=dtype, generator=g, requires_grad=True)
        out = grouped_mm(x, w, counts)
        ref = torch.cat([x[0:3] @ w[0], x[3:8] @ w[2], x[8:10] @ w[3]])
        torch.testing.assert_close(out, ref)
        out.sum().backward()  # a non-contiguous incoming gradient
        gx, gw = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        ref.sum().backward()
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, w.grad)


def test_balanced_assignment_and_prediction_errors():
    idx = balanced_assignment(16, 2, 8)
    assert torch.bincount(idx.flatten(), minlength=8).tolist() == [4] * 8
    assert all(len(set(row.tolist())) == 2 for row in idx)
    # any token count routes: 6 copies over 8 experts, the first 6 get one each
    assert torch.bincount(balanced_assignment(3, 2, 8).flatten(), minlength=8).tolist() == [1] * 6 + [0] * 2
    with pytest.raises(DivisibilityError, match="top_k = 9 exceeds num_experts = 8"):
        balanced_assignment(3, 9, 8)
    # 6 experts over ep=4 (rank 0 owns 2), 32 copies: rank 0 receives 4 x (6 + 6) = 48 rows, sends 32
    rows = expert_parallel_collectives(ExpertParallel(), tokens=16, hidden=8, ffn=8, top_k=2, experts=6,
                                       dtype_bytes=2, ep=4)
    assert sorted((r.phase, r.nbytes) for r in rows if r.nbytes > 64) == [("backward", 32 * 16), ("backward", 48 * 16),
                                                                          ("forward", 32 * 16), ("forward", 48 * 16)]
    rows = ExpertParallel().predicted_collectives(tokens=16, hidden=8, ffn=8, top_k=2, experts=8, dtype_bytes=2, ep=1)
    assert rows == []


def test_missing_mesh_dimensions_are_typed_errors_before_any_change():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = build_moe()
        for style, dim in ((ExpertParallel(), "ep"), (ExpertParallel(ep_dim="dp", tp_dim="mp"), "mp")):
            with pytest.raises(MeshError, match=f"mesh dimension '{dim}' not found"):
                parallelize_module(model, mesh, {"layers.*.feed_forward.experts": style}, mesh_dim="tp")
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())
