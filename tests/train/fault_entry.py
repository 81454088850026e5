"""``python -m tests.train.fault_entry TRAIN-ARGS...``: ``autoplan.cli.main`` where one rank kills
itself (SIGKILL, as an OOM killer or a lost node would) before a given step, once.

For the fault tests under torchrun (tests/train/test_fault_restart.py): ``FAULT_KILL_STEP=k[,k2]``
kills rank ``FAULT_KILL_RANK`` (default 1) as it starts step k (and k2); ``FAULT_KILL_MARKER``
names files ``<marker>.<k>`` created just before each kill, so the restarted job -- torchrun's
next attempt or the same command run again -- is not killed at the same step a second time. The library has no fault hooks: this wraps
``Trainer.train_step`` from outside.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _arm() -> None:
    steps = [int(k) for k in os.environ.get("FAULT_KILL_STEP", "").split(",") if k]
    marker = os.environ.get("FAULT_KILL_MARKER", "fault-killed")
    if not steps or int(os.environ.get("RANK", "0")) != int(os.environ.get("FAULT_KILL_RANK", "1")):
        return
    from autoplan.train.loop import Trainer

    original = Trainer.train_step

    def train_step(self):
        done = Path(f"{marker}.{self.step + 1}")
        if self.step + 1 in steps and not done.exists():
            done.write_text(f"killed rank {os.environ.get('RANK')} before step {self.step + 1}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    Trainer.train_step = train_step


if __name__ == "__main__":
    _arm()
    from autoplan.cli import main

    sys.exit(main(sys.argv[1:]))
