"""The cost_models CLI: listing hardware and profiling a tiny model end to end."""
import pandas as pd

from autoplan.cli import main as autoplan_main
from autoplan.cost_commands import PRESETS, main


def test_hardware_listing_and_show(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "h100_sxm" in out and "ascend_910c" in out
    assert main(["hardware", "b200"]) == 0
    assert "2250000000000000.0" in capsys.readouterr().out


def test_profile_tiny_model_writes_rows_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ops.csv"
    assert main(["profile", "--model", "tiny", "--batch", "1", "--seq", "8", "--out", str(out)]) == 0
    frame = pd.read_csv(out)
    assert len(frame) > 50 and frame["time_s"].gt(0).all()
    assert list((tmp_path / "cache" / "profiles").glob("*.csv"))
    assert "distinct ops" in capsys.readouterr().out


def test_presets_follow_llama3_shapes():
    assert PRESETS["llama3-8b"]["ffn_hidden"] == 14336
    assert PRESETS["llama3-70b"]["ffn_hidden"] == 28672


def test_autoplan_forwards_the_whole_command_line(tmp_path, monkeypatch, capsys):
    """`autoplan profile --model tiny ...` reaches cost_models' parser with its options (an argparse
    REMAINDER refused a first argument that looks like an option), and so does --help."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "ops.csv"
    assert autoplan_main(["profile", "--model", "tiny", "--batch", "1", "--seq", "8", "--no-save",
                          "--out", str(out)]) == 0
    assert out.is_file()
    try:
        autoplan_main(["profile", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "--kernels" in capsys.readouterr().out


def test_autoplan_profile_errors_are_one_line(capsys):
    """Forwarded commands keep the CLI's contract: a bad argument is one line on stderr and exit 2."""
    assert autoplan_main(["profile", "--kernels", "--preset", "nosuch", "--hardware", "h100_sxm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan profile: error: UnknownPresetError") and "\n" not in err
    assert autoplan_main(["profile", "--kernels", "--preset", "gpt-oss-20b"]) == 2
    assert "--hardware is required" in capsys.readouterr().err
