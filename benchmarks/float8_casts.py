"""Where a tensor-parallel float8 plan departs from one device: every float8 cast of one step.

``benchmarks/float8_matrix.py`` says by how much a plan's losses differ from one device in float8;
this says where. For each tp=4 case (HF Llama, Qwen3, Mixtral's shape; tensorwise and rowwise) it
records every cast torchao's float8 Linears make in one forward and backward on the same batch --
the plan's and one device's, in the same order -- and counts the casts whose scale differs from one
device's (a scale over a shard would: a fault), whose high-precision operand differs (last bits,
from a sharded GEMM's sum order) and whose float8 values differ (such a last bit crossing a float8
rounding boundary). Data-parallel and pipeline plans cast other row blocks in another order, so
only tensor parallel is compared. Batch: 2 sequences of 16 tokens, seed 11, the matrix's first step.

    PYTHONPATH=. nice .venv/bin/python benchmarks/float8_casts.py [family ...]

Writes benchmarks/results/float8_casts.md.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pandas as pd

from autoplan.precision.eligible import float8_sites
from autoplan.precision.section import float8_section
from autoplan.verify.float8_models import FAMILIES, float8_recipe
from autoplan.verify.float8_steps import float8_casts_rank
from hyper_parallel.local import RankPool

sys.path.insert(0, str(Path(__file__).parent))
from float8_matrix import OUT, RECIPES, plan_for  # noqa: E402 - the matrix's plans, beside this file


def one(family: str, recipe: str, pool: RankPool) -> dict:
    model = float8_recipe(family).build("meta")
    plan = plan_for(model, "tp4")
    sites, kept = float8_sites(model, plan, recipe)
    plan = plan.replace(parallel={**plan.parallel,
                                  "precision": float8_section(plan, {s.fqn: recipe for s in sites}, kept)})
    ranks = pool.run(float8_casts_rank, plan.to_json(), float8_recipe(family), 2, 16)
    r0 = ranks[0]   # every rank gathers each cast whole: rank 0 sees them all
    casts = [c for c in r0["casts"] if c["comparable"]]
    flips = [(i, c["float8_differ"]) for i, c in enumerate(r0["casts"]) if c.get("float8_differ")]
    one_loss, par_loss = r0["loss"]
    first = (f"{flips[0][0]} ({'forward' if flips[0][0] < r0['forward'] else 'backward'}, "
             f"{flips[0][1]} elements)") if flips else ""
    return {"family": family, "recipe": recipe, "casts": r0["count"][0],
            "same_count": all(r["count"][0] == r["count"][1] for r in ranks),
            "scales_differ": sum(not c["scale_equal"] for c in casts),
            "operands_differ": sum(c["inputs_differ"] > 0 for c in casts),
            "casts_with_flips": len(flips), "float8_values_differ": sum(c["float8_differ"] for c in casts),
            "first_flip": first, "step1_loss_rel": abs(par_loss - one_loss) / one_loss}


def main(families: list[str]) -> None:
    with RankPool(4) as pool:
        rows = [one(family, recipe, pool) for family in families for recipe in RECIPES]
    for row in rows:
        logging.info("%s", row)
    (OUT / "float8_casts.md").write_text(
        "# Float8 casts of one tp=4 step vs one device (emulated)\n\n"
        "Written by `benchmarks/float8_casts.py` (see its docstring). Rank 0, each cast gathered whole: casts: "
        "forward and backward, in order (same_count: as many as one device's on every rank); scales_differ: "
        "casts whose scale is not one device's; operands_differ: casts whose high-precision operand differs in "
        "any element; casts_with_flips / float8_values_differ: casts with float8 elements that differ, and "
        "how many elements; first_flip: the first such cast (its index, forward or backward, elements); "
        "step1_loss_rel: the step's loss against one device's.\n\n"
        + pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3g") + "\n")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(sys.argv[1:] or list(FAMILIES))
