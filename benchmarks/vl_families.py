"""transformers' vision-language families planned with tensor parallelism, as a new user would:
a tiny config per family (tests/capture/vl_families.py), no ``extra_inputs`` hook.

Each family is planned on meta at 32x the small widths with 224-pixel images (448 for the pooling
families, 112-pixel tiles for LLaVA-NeXT) on a (tp=4) mesh with a 512-token batch, then the plan's
styles are applied to the small copy (``width=1``, images a quarter the size) on 4 gloo ranks and
one SGD step compared with one device
(loss rtol 1e-5, every gradient rtol 1e-4 / atol 1e-6). Outcome per family:

- EQUAL: trained equal; ``tower`` / ``decoder`` say whether the plan shards the vision tower's and
  the language model's attention or MLP;
- REFUSED: autoplan raised a typed error (the reason is listed);
- DP ONLY: capture could not run the model on meta, so the planner planned data parallelism only
  (its note, listed, names the module and the reason; nothing is sharded, nothing trains wrong);
  REFUSED instead when the same plan for a model that needs sharding
  (``allow_replicated_units=False``) raises the typed UnshardedPlanError naming the construct;
- WRONG / CRASH / UNTYPED: bugs.

Florence-2 (no image size in its config) is refused without a hook; with a hook it is also run
data-parallel on 2 ranks (its encoder-decoder forward used to drop the images).

With ``--hook`` every family gets a user's ``extra_inputs`` hook instead (a processor's outputs:
image tokens, pixels, the grid or the image sizes, on the tokens' device;
``tests.capture.vl_families.processor_hook``).

    .venv/bin/python benchmarks/vl_families.py [--hook] [family ...]
Writes benchmarks/results/vl_families{,_hook}.csv and .md (all families only).
"""
from __future__ import annotations

import re
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from autoplan import MeshSpec, autoplan
from autoplan.capture.image_inputs import ImageBatch
from autoplan.errors import AutoplanError, UnshardedPlanError
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.local import RankPool
from tests.capture.vl_families import FAMILIES, build, build_with_hook

HERE = Path(__file__).parent


def florence2_with_images() -> torch.nn.Module:
    """Florence-2 with the hook its config cannot do without: 17 image tokens per 32x32 image."""
    torch.manual_seed(0)
    model = build("florence2")
    model.extra_inputs = ImageBatch(100, 17, (3, 32, 32), "pixels", torch.float32)
    return model


def _sections(plan, model) -> tuple[bool, bool]:
    """Whether the plan shards an attention or MLP unit of the vision tower, and of the language
    model (the module the model's own ``get_decoder`` returns: ``language_model``, ``text_model``)."""
    decoder = model.get_decoder()
    prefix = next((n for n, m in model.named_modules() if m is decoder and n), "language_model")
    units = [d["unit"] for d in plan.decisions
             if d["strategy"] != "replicate" and d["unit"].endswith(("/attention", "/mlp"))]
    return (any("vision" in u or "visual" in u for u in units), any(u.startswith(prefix + ".") for u in units))


def run_family(family: str, pool4: RankPool, hook: bool = False) -> dict:
    t0 = time.perf_counter()
    row = dict(family=family, outcome="", tower=False, decoder=False, detail="")
    make = build_with_hook if hook else build
    try:
        with torch.device("meta"):
            wide = make(family, 32, 8)
        plan = autoplan(wide, MeshSpec((4,), ("tp",)), batch=(2, 512))
    except AutoplanError as exc:
        row.update(outcome="REFUSED", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
    except Exception as exc:  # noqa: BLE001 - an untyped failure is a result here
        row.update(outcome="UNTYPED", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
    else:
        row["tower"], row["decoder"] = _sections(plan, wide)
        untraced = next((n for n in plan.notes if n.startswith("capture could not trace")), None)
        if untraced is not None:   # the planner's answer to a model capture cannot run: data parallel only
            row.update(outcome="DP ONLY", detail=untraced[:300])
            try:   # and to the same model when it needs sharding: a typed refusal naming the construct
                autoplan(wide, MeshSpec((4,), ("tp",)), batch=(2, 512), allow_replicated_units=False)
            except UnshardedPlanError as exc:
                row.update(outcome="REFUSED", detail=f"{type(exc).__name__}: {str(exc)[:300]}")
            row["seconds"] = round(time.perf_counter() - t0, 1)
            return row
        recipe = ModelRecipe(factory=f"tests.capture.vl_families:{make.__name__}",
                             kwargs={"family": family, "image": 2}, seed=3)
        result = check_numerics(plan, recipe, pool=pool4, seq=40)
        row.update(outcome="EQUAL" if result.passed else ("CRASH" if result.error else "WRONG"),
                   detail=result.summary()[:300])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def run_florence2(pool2: RankPool) -> dict:
    t0 = time.perf_counter()
    plan = autoplan(florence2_with_images(), MeshSpec((2,), ("dp",)), batch=(2, 40))
    recipe = ModelRecipe(factory="benchmarks.vl_families:florence2_with_images", seed=5)
    result = check_numerics(plan, recipe, pool=pool2, global_batch=2, seq=40)
    outcome = "EQUAL" if result.passed else ("CRASH" if result.error else "WRONG")
    lines = (result.error or "").strip().splitlines()   # the exception's own line, not a repr's tail
    detail = next((ln for ln in reversed(lines) if re.match(r"[\w.]+(Error|Exception): ", ln)),
                  lines[-1] if lines else result.summary())
    return dict(family="florence2 (hook, dp=2)", outcome=outcome, tower=False, decoder=False, detail=detail[:300],
                seconds=round(time.perf_counter() - t0, 1))


def main(families=FAMILIES, hook: bool = False) -> pd.DataFrame:
    pool4 = RankPool(4)
    try:
        rows = []
        for f in families:
            rows.append(run_family(f, pool4, hook))
            print(rows[-1], flush=True)
    finally:
        pool4.close()
    if "florence2" in families and not hook:
        pool2 = RankPool(2)
        try:
            rows.append(run_florence2(pool2))
        except Exception:  # noqa: BLE001
            rows.append(dict(family="florence2 (hook, dp=2)", outcome="CRASH", detail=traceback.format_exc()[-300:]))
        finally:
            pool2.close()
    df = pd.DataFrame(rows)
    if families == FAMILIES:
        name = "vl_families_hook" if hook else "vl_families"
        df.to_csv(HERE / "results" / f"{name}.csv", index=False)
        counts = df.outcome.value_counts().to_dict()
        both = int(((df.outcome == "EQUAL") & df.tower & df.decoder).sum())
        (HERE / "results" / f"{name}.md").write_text(
            f"# transformers VL families at tp=4 ({'a processor-like extra_inputs hook' if hook else 'no hook'})\n\n"
            f"Outcomes: {counts}; trained equal with both the tower and the decoder sharded: {both}.\n"
            f"Regenerate: `.venv/bin/python benchmarks/vl_families.py{' --hook' if hook else ''}`.\n\n"
            + df.to_markdown(index=False) + "\n")
    return df


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--hook"]
    main(tuple(args) or FAMILIES, hook="--hook" in sys.argv[1:])
