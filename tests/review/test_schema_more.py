"""Plan files a person may hand us broken: every corruption is a PlanSchemaError with a clear
message (tests/planner/test_plan_data.py covers version 99, EvilParallel, a non-placement,
a bad mesh shape, a missing section and one truncation; these add the rest)."""
from __future__ import annotations

import json

import pytest
import torch

from autoplan import MeshSpec, Plan, autoplan
from autoplan.errors import PlanSchemaError
from autoplan.models import build_llama

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128, max_seq_len=32)


@pytest.fixture(scope="module")
def text():
    plan = autoplan(build_llama(device="meta", **SMALL), MeshSpec((2, 2), ("dp", "tp"), "cpu"), batch=(4, 16),
                    dtype=torch.float32)
    return plan.to_json()


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 0.9, 0.999])
def test_truncated_anywhere(text, fraction):
    with pytest.raises(PlanSchemaError, match="corrupted or truncated"):
        Plan.from_json(text[: int(len(text) * fraction)])


@pytest.mark.parametrize("damage", [
    lambda t: t.replace('"styles": {', '"styles": {{', 1),
    lambda t: t.replace(":", ";", 3),
    lambda t: "{" + t[1:].replace('"', "'", 5),
    lambda t: t + "}garbage",
])
def test_corrupted_text(text, damage):
    with pytest.raises(PlanSchemaError, match="corrupted or truncated"):
        Plan.from_json(damage(text))


def test_missing_file(tmp_path):
    with pytest.raises(PlanSchemaError, match="No such file"):
        Plan.from_json(tmp_path / "missing.json")


def test_binary_garbage_file_on_disk(text, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(text.encode()[:100] + b"\x00\xff\xfe" + text.encode()[100:])
    with pytest.raises(PlanSchemaError, match="not UTF-8"):
        Plan.from_json(path)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema_version="1"), "schema_version '1' is not supported"),
    (lambda d: d.pop("schema_version"), "schema_version None is not supported"),
    (lambda d: d.update(schema_version=0), "schema_version 0 is not supported"),
    (lambda d: d["parallel"]["tp"]["styles"].update({"x": {"style": "FusedMagicParallel", "args": {}}}),
     "unknown style 'FusedMagicParallel'"),
    (lambda d: d["parallel"]["tp"]["styles"].update({"x": {"style": "ColwiseParallel", "args": {"gather": True}}}),
     r"unknown argument\(s\) \['gather'\]"),
    (lambda d: d["parallel"]["tp"]["styles"].update({"x": {"style": "ColwiseParallel", "args": {}, "code": "import os"}}),
     "plan field parallel/tp/styles/x"),
    (lambda d: d["parallel"]["tp"].update(stream_layout="Q"), "plan field parallel/tp/stream_layout"),
    (lambda d: d["parallel"]["tp"].pop("styles"), "'styles' is a required property"),
    (lambda d: d["decisions"][0].pop("strategy"), "plan field decisions/0"),
    (lambda d: d["predictions"].update(step_s=-1.0), "plan field predictions/step_s"),
])
def test_schema_rejects(text, mutate, message):
    data = json.loads(text)
    mutate(data)
    with pytest.raises(PlanSchemaError, match=message):
        Plan.from_dict(data)


def test_not_an_object():
    with pytest.raises(PlanSchemaError, match="must be a JSON object, got list"):
        Plan.from_dict([1, 2])
