"""MoE checkpoints in: transformers 5's save_pretrained writes one 2-D tensor per expert
(Mixtral's ``block_sparse_moe.experts.3.w1.weight``, Qwen3-MoE's ``mlp.experts.3.gate_proj.weight``)
while the model holds fused 3-D ``gate_up_proj`` / ``down_proj``; autoplan.plan.hf_merged lays the
pieces out from transformers' own converter and each rank reads the sub-boxes it holds.

Checked on gloo ranks: under ep (2 and 4 ranks), dp x ep with FSDP, ep x tp and ep x expert-TP every loaded
parameter equals from_pretrained's exactly and the first loss equals one device's; a rank holding
1/k of the experts reads 1/k of the expert bytes; expert-TP shards (strided: a slice of the gate
and of the up half) read exactly their elements; a missing expert or one of
another shape is refused on every rank from the headers, before any byte of a tensor is read; a
converter with an operation that computes values stays refused by name.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.errors import PretrainedWeightsError
from autoplan.mesh_plan import plan_mesh
from autoplan.request import PlanRequest
from autoplan.train.model import build_model
from hyper_parallel import ParallelDims
from tests.train import moe_weights_workers
from tests.train.test_weights import _one_device_run
from tests.train.train_workers import differences

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64)
# (mesh shape, names, the experts' tp dim): ep x tp with the experts whole per ep rank, and with expert TP
# (ExpertParallel(tp_dim="tp"): gate_up a strided shard -- each rank a slice of the gate and of the up half)
MESHES = {2: [((2,), ("ep",), None)],
          4: [((4,), ("ep",), None), ((2, 2), ("dp", "ep"), None), ((2, 2), ("ep", "tp"), None),
              ((2, 2), ("ep", "tp"), "tp")]}


def _expert_bytes(path) -> int:
    from autoplan.plan.pretrained import read_headers
    return sum(4 * torch.Size(shape).numel() for k, (shape, _, _) in read_headers(path).items() if ".experts." in k)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """A tiny Mixtral (4 experts, one file) and a tiny Qwen3-MoE (8 experts, a sharded index), and
    plans sharding their experts over ep (with FSDP over dp, beside tp)."""
    d = tmp_path_factory.mktemp("moe")
    torch.manual_seed(7)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0))
    mixtral.save_pretrained(d / "mixtral")
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True))
    qwen.save_pretrained(d / "qwen3_moe", max_shard_size="60KB")
    assert (d / "qwen3_moe/model.safetensors.index.json").is_file()
    plans = {}
    for ck in ("mixtral", "qwen3_moe"):
        meta = build_model(str(d / ck), device="meta")
        for world, meshes in MESHES.items():
            for shape, names, expert_tp in meshes:
                plan = plan_mesh(meta, ParallelDims(shape, names, hardware="cpu"),
                                 PlanRequest.for_mesh("plan_mesh", hardware="cpu", batch=(8, 16), dtype=torch.float32,
                                                      expert_parallel=True))
                assert plan.parallel["ep"]["styles"], (ck, names)
                spec = json.loads(plan.to_json())
                for style in spec["parallel"]["ep"]["styles"].values():   # the planner keeps tiny experts whole
                    style["args"] = {"tp_dim": expert_tp} if expert_tp else style["args"]
                plans[ck, world, names, expert_tp] = d / f"{ck}_{world}_{'x'.join(names)}_{expert_tp}.json"
                plans[ck, world, names, expert_tp].write_text(json.dumps(spec))
    return d, plans


def _check_runs(d, plans, world, pool):
    runs, shares = [], []
    for ck in ("mixtral", "qwen3_moe"):
        for shape, names, expert_tp in MESHES[world]:
            runs.append({"model": str(d / ck), "plan": str(plans[ck, world, names, expert_tp])})
            sizes = dict(zip(names, shape))   # experts over ep, then FSDP over dp or expert TP over tp
            shares.append(sizes.get("ep", 1) * sizes.get("dp", 1) * (sizes[expert_tp] if expert_tp else 1))
    results = pool.run(moe_weights_workers.load_and_step, runs)
    for i, (run, share) in enumerate(zip(runs, shares)):
        ref = transformers.AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32).state_dict()
        state = results[0][i]["state"]
        assert set(state) == set(ref), run
        assert differences(ref, state) == [], run   # exact: the loaded values are the file's
        one_loss = _one_device_run(run["model"], 1, 1e-3)[0][0]
        total = _expert_bytes(run["model"])
        for rank, res in enumerate(results):
            assert res[i]["loss"] == pytest.approx(one_loss, rel=1e-5), (run, rank)
            # each rank reads exactly its share of the expert bytes: no rank reads a merged tensor whole
            assert res[i]["reads"]["expert"] == total // share, (run, rank, res[i]["reads"], total)


def test_moe_checkpoints_load_under_ep_on_2_ranks(moe_dirs, pool2):
    _check_runs(*moe_dirs, 2, pool2)


def test_moe_checkpoints_load_under_ep_fsdp_and_tp_on_4_ranks(moe_dirs, pool4):
    _check_runs(*moe_dirs, 4, pool4)


def test_expert_tp_shards_read_exactly_their_elements(moe_dirs, pool4):
    """Expert TP's placements (hyper_parallel ExpertParallel(tp_dim=...): gate_up a strided shard of
    the ffn dim -- each rank a slice of the gate and of the up half -- and down split on it), beside
    ep: each rank's local tensor equals the fused tensor's
    slice and the bytes read are exactly its elements (one sub-box per piece it meets)."""
    d, _ = moe_dirs
    gu, down = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    cases = {
        "ep x tp gate_up": (gu, [Shard(0), _StridedShard(1, split_factor=2)]),
        "ep x tp down": (down, [Shard(0), Shard(2)]),
        "tp gate_up over both dims": (gu, [_StridedShard(1, split_factor=2), _StridedShard(1, split_factor=2)]),
        "hidden and experts": (gu, [Shard(2), Shard(0)]),
        "fsdp beside ep": (down, [_StridedShard(0, split_factor=2), Shard(0)]),
    }
    results = pool4.run(moe_weights_workers.placements_read, str(d / "qwen3_moe"), (2, 2), ("a", "b"), cases)
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert r["equal"], (rank, case, r)
            assert r["bytes"] == r["local_bytes"], (rank, case, r)


def test_broken_moe_checkpoints_are_refused_on_every_rank_before_any_read(moe_dirs, pool4):
    from safetensors.torch import load_file, save_file

    d, plans = moe_dirs
    good = d / "mixtral"
    cases = {}

    def variant(case, edit):
        shutil.copytree(good, d / case)
        tensors = load_file(d / case / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / case / "model.safetensors", metadata={"format": "pt"})
        cases[case] = (str(d / case), str(plans["mixtral", 4, ("dp", "ep"), None]))

    variant("missing", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    variant("last_missing", lambda t: [t.pop(f"model.layers.0.block_sparse_moe.experts.3.w{i}.weight")
                                       for i in (1, 2, 3)])
    variant("shape", lambda t: t.update({"model.layers.0.block_sparse_moe.experts.1.w2.weight": torch.zeros(32, 8)}))
    variant("all_shapes", lambda t: t.update({f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight":
                                              torch.zeros(8, 32) for e in range(4)}))
    results = pool4.run(moe_weights_workers.refused, cases)
    for rank_result in results:   # every rank refuses the same way, having read no tensor bytes
        assert rank_result == results[0]
    r = results[0]
    assert all(v["error"] == "PretrainedWeightsError" and v["bytes"] == 0 for v in r.values()), r
    assert r["missing"]["name"] == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert "model.layers.1.mlp.experts.gate_up_proj" in r["missing"]["message"]
    assert r["last_missing"]["name"] == "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    assert "piece 3 of 4" in r["last_missing"]["message"]
    assert r["shape"]["name"] == "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    assert tuple(r["shape"]["found"]) == (32, 8) and tuple(r["shape"]["expected"]) == (32, 16)
    assert r["all_shapes"]["name"] == "model.layers.1.mlp.experts.gate_up_proj"
    assert tuple(r["all_shapes"]["expected"]) == (4, 32, 32)


def test_a_converter_that_computes_values_is_refused_by_key(moe_dirs, monkeypatch):
    """Interleave / Transpose rearrange values inside a tensor: no box of a file tensor is a box of
    the model's, so the key is refused with the converter (typed error), as before."""
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import Concatenate, Interleave, MergeModulelist, Transpose, WeightConverter

    from autoplan.plan.hf_keys import file_to_model_names

    d, _ = moe_dirs
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d / "qwen3_moe"))
    key = "model.layers.0.mlp.experts.5.gate_proj.weight"
    assert file_to_model_names(model)(key)[0] == "model.layers.0.mlp.experts.gate_up_proj"
    for op in (Interleave(dim=1), Transpose(1, 2)):
        converter = WeightConverter(["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                                    "mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1),
                                                                            op])
        monkeypatch.setattr(cm, "get_model_conversion_mapping", lambda m, *a, **k: [converter])
        with pytest.raises(PretrainedWeightsError, match=type(op).__name__) as e:
            file_to_model_names(model)(key)
        assert e.value.name == key and "gate_up_proj" in str(e.value)
