"""Predicted equals issued on every family of the model corpus: each family is planned at its
published shape (two blocks per stack, as ``model_corpus.py`` plans it) at tp=4 and dp=2 x tp=2,
and ``verify`` dry-runs the plan on a fake process group with fake tensors -- every collective
(kind, mesh dimension, phase, bytes, count) and rank 0's parameter bytes must equal the plan's
predictions. ``model_corpus.py`` checks that the plans train right; this checks that they are
priced for what runs (a collective the cost model never saw is time it never counted).

    PYTHONPATH=. .venv/bin/python benchmarks/verify_corpus.py [family ...]
    PYTHONPATH=. .venv/bin/python benchmarks/verify_corpus.py --variant forced_S t5 bart jetmoe

Writes benchmarks/results/verify_corpus.{csv,md}: every variant of the corpus -- the default plans,
and those made with replicated units forbidden on a replicated (forced_R) or sequence-sharded
(forced_S) stream, whose entries, regions and repaired units are priced too. ``--variant`` runs
one; named families and variants replace only their rows.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pandas as pd

from autoplan.errors import AutoplanError
from autoplan.verify import verify
from autoplan.verify.corpus import FAMILIES, VARIANTS, plan_case

OUT = Path(__file__).parent / "results"
MESHES = ("tp4", "dp2_tp2")


def one(family: str, mesh: str, variant: str = "default") -> dict:
    t0 = time.perf_counter()
    row = {"family": family, "mesh": mesh, "variant": variant}
    try:
        model, plan = plan_case(family, mesh, variant)
    except AutoplanError as exc:
        return dict(row, outcome="REFUSED", detail=f"{type(exc).__name__}: {exc}"[:200],
                    seconds=time.perf_counter() - t0)
    result = verify(plan, model)
    bad = result.mismatches() if result.error is None else None
    detail = result.error or ("" if result.passed else "; ".join(
        f"{r.kind} {r.mesh_dim} {r.phase} {r.bytes} B: predicted {r.predicted}, issued {r.issued}"
        for r in bad.itertuples()))
    pb = result.param_bytes or {}
    if pb and pb.get("predicted") != pb.get("issued"):
        detail = (detail + "; " if detail else "") + f"parameter bytes predicted {pb['predicted']:,}, issued " \
                                                     f"{pb['issued']:,}"
    return dict(row, outcome="EQUAL" if result.passed else ("DRY_RUN_FAILS" if result.error else "DIFFERS"),
                detail=detail[:400], seconds=time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)
    variants = tuple(VARIANTS)
    if argv[:1] == ["--variant"]:
        if len(argv) < 2 or argv[1] not in VARIANTS:
            raise SystemExit(f"--variant: one of {sorted(VARIANTS)}, got {argv[1:2]!r}")
        variants, argv = (argv[1],), argv[2:]
    families = tuple(argv) or FAMILIES
    t0 = time.perf_counter()
    rows = []
    for family in families:
        for variant in variants:
            for mesh in MESHES:
                r = one(family, mesh, variant)
                rows.append(r)
                print(f"{family:16s} {mesh:8s} {variant:9s} {r['outcome']:13s} {r['detail'][:150]}", flush=True)
    frame = pd.DataFrame(rows)
    csv = OUT / "verify_corpus.csv"
    if csv.exists():   # keep the rows of the families and variants not rerun
        old = pd.read_csv(csv, keep_default_na=False)
        if "variant" not in old:
            old["variant"] = "default"
        kept = old[~(old["family"].isin(families) & old["variant"].isin(variants))]
        frame = pd.concat([kept, frame])
    order = {f: i for i, f in enumerate(FAMILIES)}
    vorder = {v: i for i, v in enumerate(VARIANTS)}
    frame = frame.sort_values(["family", "variant"], key=lambda c: c.map(order) if c.name == "family" else
                              c.map(vorder), kind="stable").reset_index(drop=True)
    frame = frame[["family", "mesh", "variant", "outcome", "detail", "seconds"]]
    frame.to_csv(csv, index=False)
    counts = frame["outcome"].value_counts().to_dict()
    lines = ["# Model corpus: predicted equals issued", "",
             "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/verify_corpus.py [family ...]` (named families "
             f"replace their rows; last run: {len(rows)} cases in {time.perf_counter() - t0:.0f} s here).", "",
             "Each family of `autoplan.verify.corpus` planned at its published shape (2 blocks per stack) on H100 "
             "settings, batch (4·dp, 2048), bf16, in each corpus variant (default options; replicated units forbidden "
             "on a replicated or on a sequence-sharded stream); `verify(plan, model)` applies the plan on a fake "
             "process group of 4 ranks, runs one step on fake tensors and compares every collective (kind, mesh "
             "dimension, phase, bytes, count) and rank 0's parameter bytes with the plan's predictions. EQUAL: all "
             "agree exactly; DIFFERS: the rows that do not; DRY_RUN_FAILS: the model's code cannot run on fake "
             "tensors (a data-dependent shape), so nothing was compared.", "",
             "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             frame[["family", "mesh", "variant", "outcome", "detail"]].to_markdown(index=False)]
    (OUT / "verify_corpus.md").write_text("\n".join(lines) + "\n")
    return 1 if (frame["outcome"] == "DIFFERS").any() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
