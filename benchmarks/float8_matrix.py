"""Float8 plans against one device in float8: HF Llama, Qwen3 and Mixtral's shape, at tp=4,
dp=2 x tp=2 (FSDP, tensorwise weights gathered in float8) and pp=2 x tp=2, tensorwise and rowwise.

Each case plans the small copy (``autoplan.verify.float8_models``) with sharded units forced, puts
every Linear float8 can take on that plan's shards in float8 (``autoplan.precision``: the head,
routers and shapes it cannot take stay in high precision, as the plan's notes say), and runs five
SGD steps (lr 0.1) of the plan, of one device in the same float8 recipe and of one device in high
precision, all emulated on CPU ranks (``autoplan.verify.float8_steps``). EQUAL: every step's loss
within rtol 1e-4 of one device in float8.

    PYTHONPATH=. nice .venv/bin/python benchmarks/float8_matrix.py [family ...]

Writes benchmarks/results/float8_matrix.{csv,md}.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.precision.eligible import float8_sites
from autoplan.precision.section import float8_section
from autoplan.verify.float8_models import FAMILIES, float8_recipe
from autoplan.verify.float8_steps import check_float8_steps
from hyper_parallel.local import RankPool

OUT = Path(__file__).parent / "results"
LAYOUTS = ("tp4", "dp2_tp2", "pp2_tp2")
RECIPES = ("tensorwise", "rowwise")


def plan_for(model, layout: str):
    if layout == "pp2_tp2":
        return plan_cluster(model, 4, hardware="h100_sxm", batch=(8, 16), constraints={"pp": 2, "tp": 2, "dp": 1},
                            dtype=torch.float32, allow_replicated_units=False)
    shape, names = ((4,), ("tp",)) if layout == "tp4" else ((2, 2), ("dp", "tp"))
    return autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(4, 16), dtype=torch.float32,
                    allow_replicated_units=False, sequence_parallel=layout == "tp4")


def one(family: str, layout: str, recipe: str, pool: RankPool) -> dict:
    t0 = time.perf_counter()
    model = float8_recipe(family).build("meta")
    plan = plan_for(model, layout)
    sites, kept = float8_sites(model, plan, recipe)
    plan = plan.replace(parallel={**plan.parallel,
                                  "precision": float8_section(plan, {s.fqn: recipe for s in sites}, kept)})
    r = check_float8_steps(plan, float8_recipe(family), pool=pool)
    return {"family": family, "layout": layout, "recipe": recipe,
            "outcome": "EQUAL" if r.passed else ("ERROR" if r.error else "DIFFERS"),
            "float8_linears": r.float8_modules, "gathered_in_float8": r.gathered,
            "max_rel_vs_float8": r.max_rel_float8, "noise_floor": r.max_rel_noise, "max_rel_vs_high": r.max_rel_high,
            "losses": " ".join(f"{x:.6f}" for x in r.par), "error": (r.error or "")[-300:],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(families: list[str]) -> None:
    rows = []
    with RankPool(4) as pool:
        for family in families:
            for layout in LAYOUTS:
                for recipe in RECIPES:
                    rows.append(one(family, layout, recipe, pool))
                    logging.info("%s", rows[-1])
    df = pd.DataFrame(rows)
    df.to_csv(OUT / "float8_matrix.csv", index=False)
    table = df.drop(columns=["error"]).to_markdown(index=False, floatfmt=".3g")
    (OUT / "float8_matrix.md").write_text(
        "# Float8 plans vs one device in float8 (emulated, 5 SGD steps, lr 0.1)\n\n"
        "Written by `benchmarks/float8_matrix.py` (see its docstring). max_rel_vs_float8: largest relative loss "
        "difference from one device in the same recipe over the five steps; max_rel_vs_high: from one device in "
        "high precision (float8 changed the numbers); noise_floor: one device in float8 against itself with every "
        "weight one float32 ulp off (float8 rounding of last-bit differences, which a sharded GEMM's summation order "
        "makes).\n\n" + table + "\n")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:] or list(FAMILIES))
