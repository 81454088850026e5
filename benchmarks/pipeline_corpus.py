"""Pipelines for every corpus family, planned by ``plan_cluster`` with pp=2 x tp=2 and
pp=2 x dp=2 fixed, each run on a small copy on 4 gloo ranks against one device (loss rtol 1e-5,
every gradient rtol 1e-4 / atol 1e-6). The stages run the model's own forward between their cuts
(hyper_parallel/core/pipeline_parallel/forward_split.py); no family has an adapter.

Usage (a partial run replaces only the named families' rows):
``PYTHONPATH=. .venv/bin/python benchmarks/pipeline_corpus.py [family ...]``
-> benchmarks/results/pipeline_corpus.{csv,md}
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import pandas as pd

from autoplan.verify.corpus import FAMILIES, PIPELINED, run_case
from hyper_parallel.local import RankPool

RESULTS = Path(__file__).parent / "results" / "pipeline_corpus"


def measure(families) -> pd.DataFrame:
    """One row per (family, pipelined mesh): the corpus outcome and its detail."""
    rows = []
    with RankPool(4, timeout_s=300) as pool:
        for family, mesh in ((f, m) for f in families for m in PIPELINED):
            r = run_case(family, mesh, "default", pool=pool)
            print(f"{r.family:16s} {r.mesh:8s} {r.outcome:8s} {r.seconds:6.1f}s | {r.detail[:160]}", flush=True)
            rows.append(dataclasses.asdict(r))
    return pd.DataFrame(rows)


def merged(frame: pd.DataFrame, families) -> pd.DataFrame:
    """``frame`` with the stored rows of the families not rerun."""
    csv = RESULTS.with_suffix(".csv")
    if tuple(families) == FAMILIES or not csv.exists():
        return frame
    old = pd.read_csv(csv, keep_default_na=False)
    order = {f: i for i, f in enumerate(FAMILIES)}
    return (pd.concat([old[~old["family"].isin(families)], frame])
            .sort_values("family", key=lambda c: c.map(order), kind="stable").reset_index(drop=True))


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    families = tuple(argv) or FAMILIES
    t0 = time.perf_counter()
    frame = merged(measure(families), families)
    frame.to_csv(RESULTS.with_suffix(".csv"), index=False)
    counts = frame["outcome"].value_counts().to_dict()
    table = frame.pivot(index="family", columns="mesh", values="outcome").reindex(
        [f for f in FAMILIES if f in set(frame["family"])])
    lines = ["# Pipeline corpus: every family at pp=2 x tp=2 and pp=2 x dp=2 equals one device or is refused", "",
             "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/pipeline_corpus.py [family ...]` (last run: "
             f"{len(families) * len(PIPELINED)} cases in {time.perf_counter() - t0:.0f} s here).", "",
             "Planned by `plan_cluster` with the degrees fixed (its search picks schedule, micro-batches and cuts), "
             "fp32; run on a small copy (every parameter perturbed) on 4 gloo ranks for one step against one device.",
             "", "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             table.to_markdown(), "", "## Details", "",
             frame[["family", "mesh", "outcome", "detail"]].to_markdown(index=False)]
    RESULTS.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return int(not frame["outcome"].isin(["EQUAL", "REFUSED"]).all())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
