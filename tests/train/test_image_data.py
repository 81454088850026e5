"""Image-text data on one process (autoplan/train/images.py): the two local formats, the typed
refusals, targets that equal transformers' own labels, and a batch split by sample that equals
the whole batch -- the pieces tests/train/test_images.py runs on 4 ranks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from autoplan.train import DataError, TrainConfig, TrainConfigError
from autoplan.train.images import (
    GlobalTokenMeanLoss, ImageTextBatches, check_plan, data_format, load_processor, open_image_text, read_pairs,
)
from autoplan.train.model import build_model
from tests.train import image_sets

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("image_data")
    image_sets.llava_checkpoint(d / "llava")
    image_sets.qwen2_vl_checkpoint(d / "qwen2_vl")
    sizes = ((28, 28), (56, 28), (56, 56))
    return {"root": d, "jsonl": image_sets.jsonl_set(d / "pairs", sizes=sizes),
            "folder": image_sets.folder_set(d / "folder", sizes=sizes)}


def _batches(made, family: str, rows, seq: int = 32) -> ImageTextBatches:
    cfg = TrainConfig(model=str(made["root"] / family), data=str(made["folder"]), batch=4, seq=seq)
    source = open_image_text(cfg, build_model(cfg.model, device="meta"))
    return ImageTextBatches(source.pairs, source.processor, batch=4, seq=seq, rows=rows, ignore=set(source.ignore),
                            source=cfg.data)


def test_jsonl_and_folder_give_the_same_pairs_in_order(made):
    a, b = read_pairs(str(made["jsonl"])), read_pairs(str(made["folder"]))
    assert [p.text for p in a] == [p.text for p in b] == [image_sets.caption(i) for i in range(16)]
    assert all(x.image.read_bytes() == y.image.read_bytes() for x, y in zip(a, b))
    assert data_format(TrainConfig(data=str(made["jsonl"]))) == data_format(TrainConfig(data=str(made["folder"]))) \
        == "image-text"
    text = made["root"] / "text.jsonl"   # a .jsonl of text records stays token data
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    assert data_format(TrainConfig(data=str(text))) == "tokens"


def _refused(data: str, *fragments: str):
    with pytest.raises(DataError) as e:
        read_pairs(data)
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_a_broken_set_is_refused_naming_the_place(made):
    root = made["root"]
    lines = made["jsonl"].read_text().splitlines()
    bad = made["jsonl"].parent   # beside data.jsonl: its lines' image paths resolve
    (bad / "missing.jsonl").write_text("\n".join(lines[:2] + [json.dumps({"image": "nope.png", "text": "x"})]))
    _refused(str(bad / "missing.jsonl"), "missing.jsonl line 3", "'nope.png'", "no such file")
    (bad / "garbled.jsonl").write_text(lines[0] + "\n{not json\n")
    _refused(str(bad / "garbled.jsonl"), "line 2", "not JSON")
    (bad / "no_text.jsonl").write_text(json.dumps({"image": "x.png"}) + "\n")
    _refused(str(bad / "no_text.jsonl"), "line 1", 'a string "text"')
    (bad / "pairs.csv").write_text("image,text\n")
    with pytest.raises(DataError, match="not a .jsonl file or a folder"):
        read_pairs(str(bad / "pairs.csv"))
    lonely = root / "lonely"
    shutil.copytree(made["folder"], lonely)
    (lonely / "03.txt").unlink()
    _refused(str(lonely), "'03.png' has no text '03.txt'")
    orphan = root / "orphan"
    shutil.copytree(made["folder"], orphan)
    (orphan / "05.png").unlink()
    _refused(str(orphan), "text '05.txt' has no image")
    (root / "empty").mkdir()
    _refused(str(root / "empty"), "no image-text pairs")
    with pytest.raises(TrainConfigError, match="--data-format 'images': valid: auto, tokens, image-text"):
        TrainConfig(data_format="images").check()


def test_a_model_without_processor_or_tower_is_refused(made):
    with pytest.raises(DataError, match="--model 'hf:llava' is not a save_pretrained directory"):
        load_processor(TrainConfig(model="hf:llava", data=str(made["folder"])))
    with pytest.raises(DataError, match="--tokenizer 'tok.json' is not a save_pretrained directory"):
        load_processor(TrainConfig(model=str(made["root"] / "llava"), tokenizer="tok.json", data=str(made["folder"])))
    bare = made["root"] / "bare"   # the weights' config without the processor
    bare.mkdir()
    shutil.copy(made["root"] / "llava/config.json", bare / "config.json")
    with pytest.raises(DataError, match="AutoProcessor could not load one from"):
        load_processor(TrainConfig(model=str(bare), data=str(made["folder"])))
    cfg = TrainConfig(model="hf:llama", data=str(made["folder"]), model_args=dict(num_hidden_layers=1))
    with pytest.raises(DataError, match="has no vision tower"):
        open_image_text(cfg, build_model(cfg.model, overrides=cfg.model_args, device="meta"))
    with pytest.raises(DataError, match="--seq 8; give --seq 1[0-9] or more"):
        _batches(made, "llava", [0], seq=8).next()


def test_pipelines_and_context_parallel_are_refused():
    """A stage or a sequence chunk would need its own share of the image inputs."""
    from types import SimpleNamespace

    with pytest.raises(TrainConfigError, match=r"pipelined plan \(pp=2\).*valid: plans of one stage"):
        check_plan(SimpleNamespace(mesh={"names": ["pp", "tp"], "shape": [2, 2]}, pipeline={"pp": 2}))
    with pytest.raises(TrainConfigError, match=r"context parallelism \(cp=2\)"):
        check_plan(SimpleNamespace(mesh={"names": ["cp", "tp"], "shape": [2, 2]}, pipeline=None))
    check_plan(SimpleNamespace(mesh={"names": ["dp", "tp"], "shape": [2, 2]}, pipeline={"pp": 1}))


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_targets_give_transformers_own_loss(made, family):
    """One global batch's loss equals the model's own with labels masked on padding and image
    tokens (transformers shifts them itself)."""
    data = _batches(made, family, [0, 1, 2, 3])
    inputs, targets, extra = data.next()
    model = transformers.AutoModelForImageTextToText.from_pretrained(made["root"] / family, dtype=torch.float32)
    labels = inputs.masked_fill(extra["attention_mask"] == 0, -100)
    labels = labels.masked_fill(inputs == data.processor.image_token_id, -100)
    with torch.no_grad():
        out = model(input_ids=inputs, labels=labels, **extra)
    loss = GlobalTokenMeanLoss()
    loss.scale = 1.0 / int((targets != -100).sum())
    assert float(loss(out.logits, targets)) == pytest.approx(float(out.loss), rel=1e-6)
    assert int((targets != -100).sum()) < int(extra["attention_mask"].sum())   # image tokens are not counted


def test_a_batch_split_by_sample_is_the_whole_batch(made):
    """Qwen2-VL: each rank's rows, processed and collated alone, concatenate to the one-device
    batch -- and to what the processor makes of the four samples at once."""
    whole = _batches(made, "qwen2_vl", [0, 1, 2, 3]).next()
    halves = [_batches(made, "qwen2_vl", rows).next() for rows in ([0, 1], [2, 3])]
    assert [int(h[2]["pixel_values"].shape[0]) for h in halves] == [12, 20]   # unequal patch rows
    for i in (0, 1):
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])
    for key in whole[2]:
        assert torch.equal(torch.cat([h[2][key] for h in halves]), whole[2][key]), key
    data = _batches(made, "qwen2_vl", [0, 1, 2, 3])
    pairs = data.pairs[:4]
    images = [image_sets.image(i, size) for i, size in zip(range(4), ((28, 28), (56, 28), (56, 56), (28, 28)))]
    batch = data.processor(images=images, text=[data.prompt(p.text) for p in pairs], return_tensors="pt",
                           padding="max_length", max_length=32)
    assert torch.equal(batch["pixel_values"], whole[2]["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], whole[2]["image_grid_thw"])
    assert torch.equal(batch["input_ids"], whole[0])
