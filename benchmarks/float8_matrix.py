"""Float8 plans against one device in float8: HF Llama, Qwen3 and Mixtral's shape, at tp=4,
dp=2 x tp=2 (FSDP, tensorwise weights gathered in float8) and pp=2 x tp=2, tensorwise and rowwise,
under two optimizer settings.

Each case plans the small copy (``autoplan.verify.float8_models``) with sharded units forced, puts
every Linear float8 can take on that plan's shards in float8 (``autoplan.precision``: the head,
routers and shapes it cannot take stay in high precision, as the plan's notes say), and runs five
optimizer steps of the plan, of one device in the same float8 recipe (on the whole batch; with
every weight one ulp off -- the noise floor; and with the batch split as the plan splits it) and
of one device in high precision, all emulated on CPU ranks (``autoplan.verify.float8_steps``).
EQUAL: every step's loss within rtol 1e-4 of one device in float8 on the whole batch.

Settings, the same for every case (none tuned per case): SGD at lr 0.1 (the original check: a
large step, so a wrong gradient shows quickly) and AdamW at lr 1e-4 (torch's defaults otherwise):
AdamW is what LLM pretraining and fine-tuning run, and 1e-4 sits between fine-tuning rates
(1e-5 to 1e-4) and pretraining peaks (torchtitan's Llama 3 8B: 3e-4, reached after warmup).

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
SETTINGS = (("sgd", 0.1), ("adamw", 1e-4))


def plan_for(model, layout: str):
    if layout == "pp2_tp2":
        return plan_cluster(model, 4, hardware="h100_sxm", batch=(8, 16), constraints={"pp": 2, "tp": 2, "dp": 1},
                            dtype=torch.float32, allow_replicated_units=False)
    shape, names = ((4,), ("tp",)) if layout == "tp4" else ((2, 2), ("dp", "tp"))
    return autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(4, 16), dtype=torch.float32,
                    allow_replicated_units=False, sequence_parallel=layout == "tp4")


def one(family: str, layout: str, recipe: str, optimizer: str, lr: float, pool: RankPool) -> dict:
    t0 = time.perf_counter()
    model = float8_recipe(family).build("meta")
    plan = plan_for(model, layout)
    sites, kept = float8_sites(model, plan, recipe)
    plan = plan.replace(parallel={**plan.parallel,
                                  "precision": float8_section(plan, {s.fqn: recipe for s in sites}, kept)})
    r = check_float8_steps(plan, float8_recipe(family), pool=pool, optimizer=optimizer, lr=lr)
    return {"family": family, "layout": layout, "recipe": recipe, "optimizer": f"{optimizer} {lr:g}",
            "outcome": "EQUAL" if r.passed else ("ERROR" if r.error else "DIFFERS"),
            "float8_linears": len(r.linears), "same_linears": r.linears == r.linears_one,
            "gathered_in_float8": r.gathered, "first_step_rel": r.first_rel_float8,
            "max_rel_vs_float8": r.max_rel_float8, "max_rel_vs_split": r.max_rel_split, "noise_floor": r.max_rel_noise,
            "max_rel_vs_high": r.max_rel_high, "losses": " ".join(f"{x:.6f}" for x in r.par),
            "error": (r.error or "")[-300:], "seconds": round(time.perf_counter() - t0, 1)}


HEADER = """# Float8 plans vs one device in float8 (emulated, 5 steps: SGD lr 0.1 and AdamW lr 1e-4)

Written by `benchmarks/float8_matrix.py` (see its docstring). Columns: float8_linears: the float8
Linears the plan's ranks hold (same_linears: the same set as one device in float8);
first_step_rel: step 1's relative loss difference from one device in float8 (a forward, before any
update); max_rel_vs_float8: the largest over the five steps (EQUAL when below 1e-4);
max_rel_vs_split: from one device in float8 that splits each batch as the plan does (data-parallel
rows, then micro-batches: each block casts with its own scales); noise_floor: one device in float8
against itself with every weight one float32 ulp off; max_rel_vs_high: from one device in high
precision (float8 changed the numbers). Every case: seed 11, 2 x dp x micro-batches sequences of
16 tokens a step, 5 steps, the same two settings (SGD lr 0.1; AdamW lr 1e-4, torch's defaults
otherwise), nothing tuned per case; CPU ranks, float8 emulated (torchao, scales powers of two).
"""


def main(families: list[str]) -> None:
    rows = []
    with RankPool(4) as pool:
        for optimizer, lr in SETTINGS:
            for family in families:
                for layout in LAYOUTS:
                    for recipe in RECIPES:
                        rows.append(one(family, layout, recipe, optimizer, lr, pool))
                        logging.info("%s", rows[-1])
    df = pd.DataFrame(rows)
    df.to_csv(OUT / "float8_matrix.csv", index=False)
    write(df)


def write(df: pd.DataFrame) -> None:
    """The markdown table of ``df``, one section per optimizer setting with its outcome counts."""
    tables = []
    for setting, part in df.groupby("optimizer", sort=False):
        counts = part["outcome"].value_counts().to_dict()
        split = int((part["max_rel_vs_split"] <= 1e-4).sum())
        tables.append(f"## {setting}: " + ", ".join(f"{n} {k}" for k, n in counts.items())
                      + f"; {split} of {len(part)} within 1e-4 of one device split as the plan splits\n\n"
                      + part.drop(columns=["error", "optimizer"]).to_markdown(index=False, floatfmt=".3g"))
    (OUT / "float8_matrix.md").write_text(HEADER + "\n" + "\n\n".join(tables) + "\n")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:] or list(FAMILIES))
