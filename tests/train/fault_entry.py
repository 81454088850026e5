"""``python -m tests.train.fault_entry TRAIN-ARGS...``: ``autoplan.cli.main`` where one rank kills
itself (SIGKILL, as an OOM killer or a lost node would) before a given step, once.

For the fault tests under torchrun (tests/train/test_fault_restart.py): ``FAULT_KILL_STEP=k``
kills rank ``FAULT_KILL_RANK`` (default 1) as it starts step k; ``FAULT_KILL_MARKER`` is a file
created just before the kill, so the restarted job -- torchrun's next attempt or the same command
run again -- is not killed a second time. The library has no fault hooks: this wraps
``Trainer.train_step`` from outside.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _arm() -> None:
    step = int(os.environ.get("FAULT_KILL_STEP", "0"))
    marker = Path(os.environ.get("FAULT_KILL_MARKER", "fault-killed"))
    if not step or marker.exists() or int(os.environ.get("RANK", "0")) != int(os.environ.get("FAULT_KILL_RANK", "1")):
        return
    from autoplan.train.loop import Trainer

    original = Trainer.train_step

    def train_step(self):
        if self.step + 1 == step:
            marker.write_text(f"killed rank {os.environ.get('RANK')} before step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    Trainer.train_step = train_step


if __name__ == "__main__":
    _arm()
    from autoplan.cli import main

    sys.exit(main(sys.argv[1:]))
