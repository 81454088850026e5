"""The progress display on rank 0: a rich live bar in a terminal, plain log lines elsewhere.

A terminal gets one updating line (step, loss, tokens/s, MFU, memory); a log file or CI output
(stdout not a TTY) gets a ``logging`` line every ``log_every`` steps instead of escape codes.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from autoplan.train.errors import TrainConfigError

log = logging.getLogger("autoplan.train")


def _fmt(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']:>5d}", f"loss {row['loss']:.5f}", f"lr {row['lr']:.3g}",
             f"tok/s {row['tokens_per_s']:,.0f}"]
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.2f}%")
    parts.append(f"mem {row['memory_gib']:.2f} GiB ({row['memory_kind']})")
    return " | ".join(parts)


class Progress:
    """``update(row)`` per step, ``close()`` at the end; silent on ranks other than 0."""

    def __init__(self, mode: str, total: int, start: int, rank: int, log_every: int = 1, stream=None):
        stream = stream or sys.stdout
        if mode == "auto":
            mode = "rich" if stream.isatty() else "log"
        self.mode = mode if rank == 0 else "none"
        self.log_every = max(1, log_every)
        self._bar = None
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn

            self._bar = RichProgress(TextColumn("train"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                     TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=Console(file=stream))
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()
        elif self.mode not in ("log", "none"):
            raise TrainConfigError(f"train: --progress {mode!r}: use auto, rich, log or none")

    def update(self, row: dict[str, Any]) -> None:
        if self.mode == "rich":
            self._bar.update(self._task, completed=row["step"], info=_fmt(row))
        elif self.mode == "log" and (row["step"] % self.log_every == 0 or row.get("last")):
            log.info(_fmt(row))

    def note(self, text: str) -> None:
        if self.mode == "rich":
            self._bar.console.print(text)
        elif self.mode == "log":
            log.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
