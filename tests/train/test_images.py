"""``autoplan train`` on image-text data: a LLaVA and a Qwen2-VL checkpoint fine-tuned under
dp=2 x tp=2 on 4 gloo ranks equal one device (losses and weights after the steps).

The two families stand for the two ways images enter a model: LLaVA's ``pixel_values`` are
batch-major (one image tensor per row), Qwen2-VL's are every image's patch rows concatenated with
``image_grid_thw`` saying whose they are. The Qwen2-VL set mixes three image sizes so the two dp
ranks hold different numbers of patches (12 and 20 in the first batch): a split of the collated
tensor by row index would hand rank 1 another image's patches. Captions differ in length, so the
ranks' counted tokens differ too: a per-rank mean averaged over dp would not be one device's loss.
Each run: 3 steps, global batch 4, 32 tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.train import image_sets, image_workers

transformers = pytest.importorskip("transformers")

STEPS, LR = 3, 1e-3


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    image_sets.llava_checkpoint(d / "llava")
    image_sets.qwen2_vl_checkpoint(d / "qwen2_vl")
    return {"llava": (d / "llava", image_sets.jsonl_set(d / "pairs")),
            "qwen2_vl": (d / "qwen2_vl", image_sets.folder_set(d / "folder", sizes=((28, 28), (56, 28), (56, 56)))),
            "root": d}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _train(model: Path, data: Path, out: Path, extra: list[str], pool=None) -> tuple[list[float], dict, str]:
    args = ["train", "--model", str(model), "--data", str(data), "--batch", "4", "--seq", "32", "--steps", str(STEPS),
            "--lr", str(LR), "--progress", "log", "--metrics", str(out / "metrics.jsonl"), "--export-hf",
            str(out / "hf"), *extra]
    if pool is None:
        res = image_workers.cli(args)
    else:   # this 2-core host is shared: a 4-rank run may take minutes under load
        saved, pool.timeout_s = pool.timeout_s, max(pool.timeout_s, 600)
        try:
            res = pool.run(image_workers.cli, args)[0]
        finally:
            pool.timeout_s = saved
    assert res["rc"] == 0, res
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    return losses, _weights(out / "hf"), res["log"]


def _check_equal(four, one):
    (losses4, weights4, log4), (losses1, weights1, _) = four, one
    assert len(losses1) == STEPS and losses1[-1] < losses1[0], losses1
    assert losses4 == pytest.approx(losses1, rel=1e-5)
    assert set(weights4) == set(weights1)
    diff = torch.cat([(weights4[k] - weights1[k]).abs().flatten() for k in weights1])
    # AdamW turns a gradient that is reduction-order noise (k_proj's bias: exactly zero in exact
    # arithmetic) into a step of up to lr; every other element agrees as gradients do
    # (measured, LLaVA / Qwen2-VL: max 2.2e-5 / 1.3e-5, mean 3.4e-9 / 1.1e-9)
    assert float(diff.max()) <= LR and float(diff.mean()) < 1e-7, (float(diff.max()), float(diff.mean()))
    # quiet at the default level: rank 0 says what it does, nothing at warning level or above
    assert not [line for line in log4.splitlines() if line.startswith(("WARNING", "ERROR", "CRITICAL"))], log4


def _run_family(sets, family: str, tower_unit: str):
    """4 ranks under a plan sharding the decoder and the tower (planned once, here: planning on
    each of 4 ranks of this shared 2-core host costs minutes), then one device planned on the spot."""
    model, data = sets[family]
    root = sets["root"]
    (root / f"{family}4").mkdir(), (root / f"{family}1").mkdir()
    plan = image_sets.sharding_plan(model, root / f"{family}_plan.json")
    units = {d["unit"] for d in json.loads(plan.read_text())["decisions"] if d["strategy"] != "replicate"}
    assert tower_unit in units and "model.language_model.layers/attention" in units, units
    return _train(model, data, root / f"{family}4", ["--plan", str(plan)], sets["pool"]), \
        _train(model, data, root / f"{family}1", [])


def test_llava_jsonl_dp2_tp2_equals_one_device(sets, pool4, world_of_one):
    """A jsonl set; batch-major pixels."""
    four, one = _run_family(dict(sets, pool=pool4), "llava", "model.vision_tower.encoder.layers/mlp")
    assert "{'dp': 2, 'tp': 2}" in four[2], four[2]
    _check_equal(four, one)


def test_qwen2_vl_folder_dp2_tp2_equals_one_device(sets, pool4, world_of_one):
    """A folder set of three image sizes; patch-row pixels split by image."""
    four, one = _run_family(dict(sets, pool=pool4), "qwen2_vl", "model.visual.blocks/mlp")
    _check_equal(four, one)
