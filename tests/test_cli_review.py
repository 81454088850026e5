"""Every review command of the ``autoplan`` CLI: exit code and output (in-process, capsys)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from autoplan import Plan
from autoplan.cli import main

PRESET = ["titan-llama3-8b", "--layers", "2", "--seq", "2048"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    auto, titan, mega = d / "auto.json", d / "titan.json", d / "mega.json"
    assert main(["plan", *PRESET, "--mesh", "dp=2,tp=4", "--batch", "8", "-o", str(auto)]) == 0
    assert main(["plan", *PRESET, "--mesh", "dp=2,tp=4", "--batch", "8", "--styles", "torchtitan",
                 "-o", str(titan)]) == 0
    assert main(["plan", *PRESET, "--mesh", "dp=2,tp=4", "--batch", "8", "--styles", "megatron", "-o", str(mega)]) == 0
    return d, auto, titan, mega


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_writes_a_valid_plan_and_prints_the_table(files, capsys):
    d, auto, titan, mega = files
    plan = Plan.from_json(auto)
    assert plan.model["source"] == "titan-llama3-8b" and plan.mesh["shape"] == [2, 4]
    assert Plan.from_json(titan).model["plan_name"] == "torchtitan"
    code, out, _ = run(capsys, "show", auto)
    assert code == 0 and "Plan(mesh={'dp': 2, 'tp': 4}" in out and "layers.*.attention.wq" in out
    assert "memory per rank (GiB)" in out


def test_plan_devices_tries_meshes(capsys):
    code, out, err = run(capsys, "plan", *PRESET, "--devices", "8", "--hardware", "b200")
    assert code == 0
    for mesh in ("dp8xtp1", "dp4xtp2", "dp2xtp4", "dp1xtp8"):
        assert mesh in out
    assert "vs_best" in out and "planning meshes" in err      # the progress bar goes to stderr


def test_diff(files, capsys):
    d, auto, titan, mega = files
    code, out, _ = run(capsys, "diff", auto, titan)
    assert code == 0 and out.strip() == "plans are identical"
    code, out, _ = run(capsys, "diff", auto, mega)
    assert code == 0 and "stream_layout" in out and "differences" in out
    assert run(capsys, "diff", auto, mega, "--exit-code")[0] == 1
    assert run(capsys, "diff", auto, titan, "--exit-code")[0] == 0


def test_compare(files, capsys):
    d, auto, titan, mega = files
    csv = d / "cmp.csv"
    code, out, _ = run(capsys, "compare", auto, titan, mega, "--names", "auto,titan,mega", "--csv", csv,
                       "--strategies")
    assert code == 0 and "vs_best" in out and "tokens_per_s" in out and "unit:head" in out
    frame = pd.read_csv(csv, index_col=0)
    assert list(frame.index) == ["auto", "titan", "mega"] and frame.loc["auto", "vs_best"] == 1.0
    assert frame.loc["mega", "vs_best"] > 1.0


def test_explain(files, capsys):
    d, auto, *_ = files
    code, out, _ = run(capsys, "explain", auto, "layers.1.attention.wo")
    assert code == 0 and "unit 'layers/attention' uses 'heads_sharded'" in out and "-> chosen" in out
    assert "slower by" in out


@pytest.mark.parametrize("fmt,expect", [
    ("json", '"schema_version": 3'),
    ("python", "parallelize_module(model, mesh, tp_plan, mesh_dim='tp')"),
    ("torch", "'layers.*.attention.wq': ColwiseParallel("),
    ("hf", '"not_expressible"'),
])
def test_export(files, capsys, fmt, expect):
    d, auto, *_ = files
    code, out, err = run(capsys, "export", auto, "--format", fmt)
    assert code == 0 and expect in out
    if fmt == "hf":
        assert json.loads(out)["tp_plan"]["layers.*.attention.wq"] == "colwise"
        assert "no HF name" in err
    target = d / f"export.{fmt}"
    assert run(capsys, "export", auto, "--format", fmt, "-o", target)[0] == 0 and expect in target.read_text()


@pytest.mark.parametrize("kind", ["memory", "communication", "timeline"])
def test_plot(files, capsys, kind):
    d, auto, *_ = files
    png = d / f"{kind}.png"
    code, out, _ = run(capsys, "plot", auto, kind, "-o", png)
    assert code == 0 and str(png) in out and png.read_bytes()[:4] == b"\x89PNG"


def test_verify_dry_run(files, capsys):
    d, auto, *_ = files
    code, out, _ = run(capsys, "verify", auto)
    assert code == 0 and "PASS: predicted == issued" in out


def test_cost_model_passthrough(capsys):
    code, out, _ = run(capsys, "hardware")
    assert code == 0 and "h100_sxm" in out


@pytest.mark.parametrize("argv,fragment", [
    (["show", "no/such/plan.json"], "No such file"),
    (["diff", "only-one.json"], "the following arguments are required: b"),
    (["plan", "titan-llama3-8b", "--layers", "2"], "give --mesh dp=D,tp=T or --devices N"),
    (["plan", "titan-llama3-8b", "--layers", "2", "--mesh", "tp=4", "--styles", "bogus"], "--styles 'bogus'"),
    (["plan", "no-such-model", "--mesh", "tp=4"], "no-such-model"),
    (["plot", "x.json", "pie", "-o", "x.png"], "invalid choice: 'pie'"),
    (["nonsense"], "invalid choice: 'nonsense'"),
])
def test_errors_are_one_line_and_non_zero(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and fragment in err, err


def test_explain_unknown_module_and_corrupt_plan(files, capsys):
    d, auto, *_ = files
    code, _, err = run(capsys, "explain", auto, "nope")
    assert code == 2 and err.count("\n") == 1 and "neither a unit" in err
    bad = d / "bad.json"
    bad.write_text(auto.read_text()[:300])
    code, _, err = run(capsys, "compare", auto, bad)
    assert code == 2 and err.count("\n") == 1 and "corrupted or truncated" in err


def test_help_exits_zero(capsys):
    assert run(capsys, "--help")[0] == 0
    assert run(capsys, "compare", "--help")[0] == 0


def test_plan_prices_the_hf_plan_on_an_hf_model(capsys, tmp_path):
    out_file = tmp_path / "hf.json"
    code, out, _ = run(capsys, "plan", "llama3-8b", "--layers", "2", "--mesh", "dp=2,tp=4", "--seq", "2048",
                       "--styles", "hf", "-o", out_file)
    assert code == 0 and "model.layers.*.self_attn.o_proj" in out
    plan = Plan.from_json(out_file)
    assert plan.model["plan_name"] == "hf" and plan.stream_layout == "R" and plan.solver["status"] == "imported"
