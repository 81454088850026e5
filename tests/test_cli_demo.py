"""README's main command: ``autoplan demo`` prints the plan and equal losses."""
from autoplan.cli import main


def test_demo_prints_plan_and_equal_losses(capsys):
    code = main(["demo", "--world", "2", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "layers.*.attention.wq" in out and "ColwiseParallel" in out
    assert "EQUAL" in out


def test_bad_command_line_exits_non_zero(capsys):
    assert main(["demo", "--plan", "no-such-plan", "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-plan" in err
