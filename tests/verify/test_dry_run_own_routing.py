"""Dry runs of MoE layers whose own expert loop stays in place (DBRX's flat experts under
FlatExpertsParallel): the loop's ``nonzero`` / ``torch.where`` on the routing mask runs on the
balanced routing's values (OwnRouting), and the collectives equal the plan's predictions."""
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.verify import verify
from autoplan.verify.even_counts import EvenCounts
from hyper_parallel.local.own_routing import OwnRouting, value_of


def _tiny_dbrx():
    cfg = transformers.DbrxConfig(
        d_model=128, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=256,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    with torch.device("meta"):
        return transformers.DbrxForCausalLM(cfg)


def test_dbrx_experts_tp_dry_run_equals_predictions():
    """dp2 x tp2, every unit sharded: DBRX's experts split over tp with their own loop; before
    OwnRouting the dry run stopped at aten.nonzero (DynamicOutputShapeException)."""
    model = _tiny_dbrx()
    plan = autoplan(model, MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 32), dtype=torch.float32,
                    allow_replicated_units=False, sequence_parallel=False)
    assert any(d["unit"].endswith("/moe") and d["strategy"] == "experts_tp" for d in plan.decisions), plan.decisions
    res = verify(plan, model)
    assert res.error is None, res.error
    assert res.passed, f"mismatches\n{res.mismatches().to_string()}"
    # the routing weights' gradient (2 x 32 tokens x top-2, fp32), all-reduced over tp in backward per layer
    c = res.collectives
    row = c[(c["kind"] == "all_reduce") & (c["mesh_dim"] == "tp") & (c["phase"] == "backward") & (c["bytes"] == 512)]
    assert list(row["issued"]) == [2] and list(row["predicted"]) == [2], c.to_string()


def test_dbrx_pipeline_dry_run_equals_predictions_on_every_pipeline_rank():
    """pp2 x tp2: the stage splitter traces DBRX's forward on fake tensors (its own expert loop on
    the balanced routing's values) and the pipeline dry run of each rank matches its predictions."""
    model = _tiny_dbrx()
    plan = plan_cluster(model, 4, hardware="h100_sxm", batch=(8, 32), devices_per_node=4,
                        constraints={"pp": 2, "tp": 2, "dp": 1}, dtype=torch.float32)
    assert plan.pipeline and plan.pipeline["pp"] == 2, plan
    res = verify(plan, model)
    assert res.error is None, res.error
    assert res.passed, f"mismatches\n{res.mismatches().to_string()}"
    assert sorted(res.collectives["pp_rank"].unique()) == [0, 1]


def test_own_expert_loop_routes_balanced_on_fake_tensors():
    """An expert loop in the style of transformers' MoE code, on fake tensors: every expert gets
    the balanced router's copies (8 tokens x top-2 over 4 experts: 4 each), reads answered too."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.empty(8, 4)
        with EvenCounts(), OwnRouting() as mode:
            _, index = torch.topk(logits.softmax(-1), 2, dim=-1)
            mask = torch.nn.functional.one_hot(index, num_classes=5).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            sizes = {}
            for e in hit:
                e = e[0]
                if e == 4:
                    continue
                _, tokens = torch.where(mask[e])
                sizes[int(e)] = tokens.shape[0]
    assert sizes == {0: 4, 1: 4, 2: 4, 3: 4}
    assert mode.computed > 0
    assert value_of(logits) is None   # floating tensors never carry values
