"""The ``autoplan`` CLI with the issue-19 catalogue: each bad command line exits 2 with one line
naming the argument; legitimate ones do the right thing (in-process, capsys)."""
from __future__ import annotations

import json

import pytest

from autoplan import Plan
from autoplan.cli import main
from autoplan.presets import build_preset

SMALL = ["--layers", "1", "--seq", "64"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_1d_dp_mesh_plans_data_parallel_only(capsys, tmp_path):
    """Issue item 1: `--mesh dp=2` planned TP and FSDP on one dimension (tp_dim == dp_dim)."""
    out = tmp_path / "p.json"
    code, _, err = run(capsys, "plan", "llama3-8b", "--mesh", "dp=2", *SMALL, "-o", out)
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.tp_dim is None and plan.dp_dim == "dp" and plan.styles == {}
    assert plan.model["layers_override"] == 1


@pytest.mark.parametrize("mesh, match", [
    ("x=2,y=2", "MeshNameError: mesh dimension name 'x' does not say"),
    ("dp=2,dp=2", "given twice"), ("dp=0", "sizes >= 1"), ("dp", "expected NAME=SIZE"),
    ("fsdp=2,dp_shard=2", "both mean 'dp'"),
])
def test_bad_mesh(capsys, mesh, match):
    code, _, err = run(capsys, "plan", "llama3-8b", "--mesh", mesh, *SMALL)
    assert code == 2 and match in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--layers", "0"), ("--layers", "-1"), ("--batch", "0"), ("--seq", "-5"),
                                         ("--devices", "0"), ("--seq", "abc")])
def test_non_positive_counts(capsys, flag, value):
    code, _, err = run(capsys, "plan", "titan-llama3-8b", "--mesh", "tp=2", flag, value)
    assert code == 2 and f"argument {flag}" in err and ("must be >= 1" in err or "not an integer" in err), err


def test_seq_longer_than_positions(capsys):
    code, _, err = run(capsys, "plan", "gpt2-xl", "--mesh", "tp=2", "--layers", "1", "--seq", "2048")
    assert code == 2 and "seq_len=2048 is longer than the 1024 positions" in err, err


def test_config_json_without_model_type(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    code, _, err = run(capsys, "plan", cfg, "--mesh", "tp=2", *SMALL)
    assert code == 2 and "InvalidArgumentError" in err and '"model_type"' in err, err
    cfg.write_text("{not json")
    code, _, err = run(capsys, "plan", cfg, "--mesh", "tp=2", *SMALL)
    assert code == 2 and "not a readable JSON config" in err, err


def test_config_json_layers_override(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 6,
                               "vocab_size": 128, "max_position_embeddings": 128}))
    out = tmp_path / "p.json"
    code, _, err = run(capsys, "plan", cfg, "--mesh", "dp=2,tp=2", "--layers", "2", "--seq", "32", "-o", out)
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.model["layers_override"] == 2 and plan.model["blocks"][0]["count"] == 2


def test_verify_of_an_encoder_decoder_plan(capsys, tmp_path):
    """verify says clearly that it cannot dry-run an encoder-decoder plan."""
    out = tmp_path / "p.json"
    assert main(["plan", "titan-llama3-8b", "--mesh", "dp=2,tp=2", "--layers", "2", "--seq", "64", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    data["model"]["source"] = "t5-large"
    out.write_text(json.dumps(data))
    capsys.readouterr()
    code, _, err = run(capsys, "verify", out)
    assert code == 2 and "InvalidArgumentError: verify: T5ForConditionalGeneration is an encoder-decoder" in err, err


def test_preset_layers_and_overrides():
    from autoplan.errors import InvalidArgumentError
    from autoplan.presets import UnknownPresetError

    for n in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="num_layers=.* must be an integer >= 1"):
            build_preset("llama3-8b", num_layers=n)
    with pytest.raises(InvalidArgumentError, match="unknown config field.*hiden_size"):
        build_preset("llama3-8b", num_layers=1, hiden_size=64)
    with pytest.raises(InvalidArgumentError, match="unknown config field.*dimm"):
        build_preset("titan-llama3-8b", num_layers=1, dimm=64)
    with pytest.raises(UnknownPresetError, match="unknown preset"):
        build_preset(["llama3-8b"])
