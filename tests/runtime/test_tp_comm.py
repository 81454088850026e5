"""Collectives issued by the expert Llama plans, per module, at world 2, 4 and 64 (fake group)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel.local import fake_world
from tests.runtime import tp_workers

LAYERS = 2


def expected_torchtitan(n_layers: int) -> dict:
    """torchtitan TP+SP: per block an all-gather into attention and FFN and a reduce-scatter out
    of wo and w2 (their backward: the reverse), one all-reduce per SP norm weight gradient; the
    embedding reduce-scatters into the sequence shard; the head all-gathers it back; the loss
    (loss parallel) all-reduces 3 scalars per token outside any module."""
    sp_block = {"forward": {"all_gather": 1, "reduce_scatter": 1}, "backward": {"all_gather": 1, "reduce_scatter": 1}}
    exp = {
        "tok_embeddings": {"forward": {"reduce_scatter": 1}, "backward": {"all_gather": 1}},
        "output": {"forward": {"all_gather": 1}, "backward": {"reduce_scatter": 1}},
        "norm": {"forward": {}, "backward": {"all_reduce": 1}},
    }
    for i in range(n_layers):
        exp[f"layers.{i}.attention"] = sp_block
        exp[f"layers.{i}.feed_forward"] = sp_block
        exp[f"layers.{i}.attention.wo"] = {"forward": {"reduce_scatter": 1}, "backward": {"all_gather": 1}}
        exp[f"layers.{i}.feed_forward.w2"] = {"forward": {"reduce_scatter": 1}, "backward": {"all_gather": 1}}
        exp[f"layers.{i}.attention_norm"] = {"forward": {}, "backward": {"all_reduce": 1}}
        exp[f"layers.{i}.ffn_norm"] = {"forward": {}, "backward": {"all_reduce": 1}}
    return exp


def expected_totals_torchtitan(n_layers: int) -> dict:
    return {"all_gather": 4 * n_layers + 2, "reduce_scatter": 4 * n_layers + 2, "all_reduce": 2 * n_layers + 1 + 3}


def expected_megatron(n_layers: int) -> dict:
    """Megatron TP (no SP, head output gathered): one all-reduce forward after wo and after w2;
    in backward one all-reduce of the input gradient per column-parallel linear (q, k, v, w1, w3:
    DTensor annotates each separately) and one for the head."""
    exp = {
        "tok_embeddings": {"forward": {"all_reduce": 1}, "backward": {}},
        "output": {"forward": {"all_gather": 1}, "backward": {"all_reduce": 1}},
    }
    for i in range(n_layers):
        exp[f"layers.{i}.attention"] = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 3}}
        exp[f"layers.{i}.feed_forward"] = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}}
    return exp


def _check(totals, per, plan):
    exp = expected_torchtitan(LAYERS) if plan == "torchtitan" else expected_megatron(LAYERS)
    for fqn, phases in exp.items():
        got = per.get(fqn, {"forward": {}, "backward": {}})
        assert got == phases, f"{plan}: module {fqn}: issued {got}, expected {phases}"
    if plan == "torchtitan":
        assert totals == expected_totals_torchtitan(LAYERS)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_plan_collectives_on_gloo(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for plan in ("torchtitan", "megatron"):
        totals, per = pool.run(tp_workers.llama_plan_counts, plan, LAYERS)[0]
        _check(totals, per, plan)


@pytest.mark.parametrize("plan", ["torchtitan", "megatron"])
def test_expert_plan_collectives_at_world_64_fake_group(plan):
    with fake_world(64):
        mesh = init_device_mesh("cpu", (64,), mesh_dim_names=("tp",))
        totals, per = tp_workers.llama_plan_counts(plan, LAYERS, device="meta", mesh=mesh)
    _check(totals, per, plan)
