"""The model corpus (issue: every plan trains correctly or is refused): every family x mesh x
variant planned at its real shape, run on a small copy on 4 gloo ranks, compared with one device.

    PYTHONPATH=. .venv/bin/python benchmarks/model_corpus.py            # all cases
    PYTHONPATH=. .venv/bin/python benchmarks/model_corpus.py qwen3 t5   # rerun some families

Writes benchmarks/results/model_corpus.{csv,md} (a partial run replaces only its families' rows).
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import pandas as pd

from autoplan.verify.corpus import FAMILIES, all_cases, run_case
from hyper_parallel.local import RankPool

OUT = Path(__file__).parent / "results"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    families = tuple(argv) or FAMILIES
    rows = []
    t0 = time.perf_counter()
    with RankPool(4, timeout_s=300) as pool:
        for case in all_cases(families):
            r = run_case(*case, pool=pool)
            rows.append(dataclasses.asdict(r))
            print(f"{r.family:11s} {r.mesh:8s} {r.variant:9s} {r.outcome:8s} {r.stream} {r.sharded[:70]} "
                  f"| {r.detail[:120]}", flush=True)
    frame = pd.DataFrame(rows)
    csv = OUT / "model_corpus.csv"
    if families != FAMILIES and csv.exists():  # some families rerun: replace their rows, keep the others
        old = pd.read_csv(csv, keep_default_na=False)
        frame = pd.concat([old[~old["family"].isin(families)], frame])
        order = {f: i for i, f in enumerate(FAMILIES)}
        frame = frame.sort_values("family", key=lambda c: c.map(order), kind="stable").reset_index(drop=True)
    counts = frame["outcome"].value_counts().to_dict()
    frame.to_csv(csv, index=False)
    lines = ["# Model corpus: every plan equals one device or is refused", "",
             "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/model_corpus.py [family ...]` (named families "
             f"replace their rows; last run: {len(rows)} cases in {time.perf_counter() - t0:.0f} s here).", "",
             "Each family is planned at its published shape (2 blocks per stack) on H100 settings, batch "
             "(4·dp, 2048); the plan runs on a small copy (same architecture, head dim 8, widths keeping their "
             "residues modulo tp, every parameter perturbed) on 4 gloo ranks for one SGD step against one "
             "device: loss rtol 1e-5, every gradient and every parameter after the step rtol 1e-4 / atol 1e-6.",
             "", "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             frame[["family", "mesh", "variant", "outcome", "stream", "sharded", "detail"]].to_markdown(index=False)]
    (OUT / "model_corpus.md").write_text("\n".join(lines) + "\n")
    bad = frame[~frame["outcome"].isin(["EQUAL", "REFUSED"])]
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
