"""What the benchmarks that compare trees share: each run is named by ``--label`` (another tree is
run with ``PYTHONPATH=that/tree``) and appends its rows to one CSV, so every commit measured sits
in one table that the markdown is rebuilt from."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pandas as pd
import torch


def start(description: str | None = None) -> str:
    """The run's label, with the settings every such run uses (quiet logs, one CPU thread)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--label", required=True)
    label = ap.parse_args().label
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    return label


def append_rows(csv: Path, rows: list[dict]) -> pd.DataFrame:
    """Every row recorded so far, this run's appended (and written back to ``csv``)."""
    df = pd.concat([pd.read_csv(csv), pd.DataFrame(rows)]) if csv.exists() else pd.DataFrame(rows)
    df.to_csv(csv, index=False)
    return df
