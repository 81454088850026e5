"""Pipelines for every corpus family (issue 29): each family planned by ``plan_cluster`` with pp=2 x tp=2
and pp=2 x dp=2 fixed, run on a small copy on 4 gloo ranks and compared with one device (loss rtol
1e-5, every gradient rtol 1e-4 / atol 1e-6). The stages run the model's own forward between their
cuts (hyper_parallel/core/pipeline_parallel/forward_split.py); no family has an adapter.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_corpus.py            # every family
    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_corpus.py gpt2 opt   # rerun some families

Writes benchmarks/results/pipeline_corpus.{csv,md} (a partial run replaces only its families' rows).
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

OUT = Path(__file__).parent / "results"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    families = tuple(argv) or FAMILIES
    rows = []
    t0 = time.perf_counter()
    with RankPool(4, timeout_s=300) as pool:
        for family in families:
            for mesh in PIPELINED:
                r = run_case(family, mesh, "default", pool=pool)
                rows.append(dataclasses.asdict(r))
                print(f"{r.family:16s} {r.mesh:8s} {r.outcome:8s} {r.seconds:6.1f}s | {r.detail[:160]}", flush=True)
    frame = pd.DataFrame(rows)
    csv = OUT / "pipeline_corpus.csv"
    if families != FAMILIES and csv.exists():
        old = pd.read_csv(csv, keep_default_na=False)
        frame = pd.concat([old[~old["family"].isin(families)], frame])
        order = {f: i for i, f in enumerate(FAMILIES)}
        frame = frame.sort_values("family", key=lambda c: c.map(order), kind="stable").reset_index(drop=True)
    frame.to_csv(csv, index=False)
    counts = frame["outcome"].value_counts().to_dict()
    table = frame.pivot(index="family", columns="mesh", values="outcome").reindex(
        [f for f in FAMILIES if f in set(frame["family"])])
    lines = ["# Pipeline corpus: every family at pp=2 x tp=2 and pp=2 x dp=2 equals one device or is refused", "",
             "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/pipeline_corpus.py [family ...]` (last run: "
             f"{len(rows)} cases in {time.perf_counter() - t0:.0f} s here).", "",
             "Planned by `plan_cluster` with the degrees fixed (its search picks schedule, micro-batches and cuts), "
             "fp32; run on a small copy (every parameter perturbed) on 4 gloo ranks for one step against one device.",
             "", "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             table.to_markdown(), "", "## Details", "",
             frame[["family", "mesh", "outcome", "detail"]].to_markdown(index=False)]
    (OUT / "pipeline_corpus.md").write_text("\n".join(lines) + "\n")
    bad = frame[~frame["outcome"].isin(["EQUAL", "REFUSED"])]
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
