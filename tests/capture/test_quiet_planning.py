"""Planning writes nothing to stderr but the plan's own warnings: torch's output from the attempts
capture and the probes make and catch (a failed export's partial FX graph, fake-tensor kernel
failures with their tracebacks) goes to autoplan's debug log."""
from __future__ import annotations

import logging
import sys

import torch

from autoplan import MeshSpec, autoplan
from autoplan.capture.quiet import quiet_torch
from tests.capture.vl_families import build


def test_planning_a_vl_family_writes_only_its_warnings(capfd):
    """Mistral 3's exports fail on data-dependent image sizes: torch prints each partial graph
    and logs fake-tensor kernel failures (six of them without quiet_torch)."""
    with torch.device("meta"):
        model = build("mistral3", 4, 4)
    capfd.readouterr()
    autoplan(model, MeshSpec((4,), ("tp",)), batch=(2, 256))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "def forward" not in err and "fake_tensor" not in err, err[:2000]
    assert len(err) < 2000, err[:2000]


def test_torch_output_goes_to_the_debug_log(caplog, capfd):
    """What quiet_torch holds back is still there at DEBUG; other loggers' records pass."""
    caplog.set_level(logging.DEBUG, logger="autoplan.capture.quiet")
    with quiet_torch(prints=True):
        logging.getLogger("torch._subclasses.fake_tensor").error("kernel failed")
        print("partial graph", file=sys.stderr)
    assert "kernel failed" not in capfd.readouterr().err
    messages = [r.getMessage() for r in caplog.records if r.name == "autoplan.capture.quiet"]
    assert any("kernel failed" in m for m in messages) and any("partial graph" in m for m in messages)
