"""transformers' vision-language families pipelined, as a new user would: a tiny
config per family (tests/capture/vl_families.py), no hook, planned with ``autoplan(model, 4,
batch=..., constraints={...})`` and trained one SGD step on 4 gloo ranks against one device.

Each family is planned on meta at 32x the small widths (images of 224 pixels, 56k for the pooling
families) for a (8, 512) batch at three layouts: pp=2 x tp=2 with the tower where the planner puts
it (the faster placement the runtime runs), pp=2 x tp=2 with the tower under MPipe, and pp=4 under
MPipe. The plan is applied to the small copy (``width=1``, 56-pixel images) and compared with one
device: loss rtol 1e-5, every gradient rtol 1e-4 / atol 1e-6, the tower's included.

The stages run the model's own forward (forward_split.py): the tower is what the forward calls only
on images (stage 0's, or MPipe's ``get_image_features``), stage 0 takes its output as
``mm_encoder_outputs``, and every stage gets the token ids (M-RoPE positions, masks).

    .venv/bin/python benchmarks/vl_pipelines.py [family ...]
Writes benchmarks/results/vl_pipelines.csv and .md (all families) or prints (named ones).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch

from autoplan import autoplan
from autoplan.errors import AutoplanError
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.local import RankPool
from tests.capture.vl_families import FAMILIES, build

HERE = Path(__file__).parent
LAYOUTS = {"pp2_tp2": {"pp": 2, "tp": 2}, "pp2_tp2_mpipe": {"pp": 2, "tp": 2, "tower_placement": "mpipe"},
           "pp4_mpipe": {"pp": 4, "tower_placement": "mpipe"}}


def run(family: str, layout: str, pool4: RankPool) -> dict:
    t0 = time.perf_counter()
    row = dict(family=family, layout=layout, outcome="", placement="", schedule="", detail="")
    try:
        with torch.device("meta"):
            wide = build(family, 32, 8)
        plan = autoplan(wide, 4, batch=(8, 512), constraints=dict(LAYOUTS[layout]))
    except AutoplanError as exc:
        row.update(outcome="REFUSED", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
    except Exception as exc:  # noqa: BLE001 - an untyped failure is a result here
        row.update(outcome="UNTYPED", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
    else:
        pipe = plan.pipeline or {}
        row.update(placement=(pipe.get("preprocess") or {}).get("placement", "-"),
                   schedule=f"{pipe.get('schedule')} m{pipe.get('microbatches')}")
        recipe = ModelRecipe(factory="tests.capture.vl_families:build", kwargs={"family": family, "image": 2}, seed=3)
        result = check_numerics(plan, recipe, pool=pool4, seq=40, global_batch=8)
        row.update(outcome="EQUAL" if result.passed else ("CRASH" if result.error else "WRONG"),
                   detail=result.summary()[:300])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(families=FAMILIES) -> pd.DataFrame:
    pool4 = RankPool(4)
    try:
        rows = []
        for f in families:
            for layout in LAYOUTS:
                rows.append(run(f, layout, pool4))
                print(rows[-1], flush=True)
    finally:
        pool4.close()
    df = pd.DataFrame(rows)
    if tuple(families) == tuple(FAMILIES):
        df.to_csv(HERE / "results" / "vl_pipelines.csv", index=False)
        equal = sorted(set(df.family[df.outcome == "EQUAL"]))
        every = [f for f in equal if (df[df.family == f].outcome == "EQUAL").all()]
        (HERE / "results" / "vl_pipelines.md").write_text(
            "# transformers VL families pipelined (no hook)\n\n"
            f"Outcomes: {df.outcome.value_counts().to_dict()}; equal to one device at every layout: "
            f"{len(every)} ({', '.join(every)}).\n"
            "Regenerate: `.venv/bin/python benchmarks/vl_pipelines.py`.\n\n" + df.to_markdown(index=False) + "\n")
    return df


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or FAMILIES)
