"""Compiled plans train as eager: the model corpus's plans under torch.compile on 4 gloo ranks.

Each family is planned as ``model_corpus.py`` plans it (its published shape, two blocks per stack)
at tp=4, dp=2 x tp=2 (FSDP) and pp=2 x tp=2, plus ep=2 on the MoE families and cp=2 on two dense
ones; the plan runs on the family's small copy for 3 AdamW steps in eager, compiled per block and
compiled whole with ``aot_eager`` (eager's kernels, so the result must be eager's: losses rtol 1e-6,
parameters after the last step mean |d| <= 1e-8, and no graph break inside a block), and on a few
families at tp=4 per block with ``inductor`` against one device (rtol 1e-4: fused kernels round
differently).

    PYTHONPATH=. nice .venv/bin/python benchmarks/compile_corpus.py [family ...]

Writes benchmarks/results/compile_corpus.{csv,md}; named families replace only their rows.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from autoplan.cluster import plan_cluster
from autoplan.errors import AutoplanError
from autoplan.verify.compiled import check_compiled
from autoplan.verify.corpus import PIPELINED, plan_case, seq_len, small_recipe
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.local import RankPool

OUT = Path(__file__).parent / "results"
FAMILIES = ("llama", "qwen3", "gemma2", "gpt2", "phi3", "mixtral", "deepseek_v3", "gpt_neox", "olmo2",
            "starcoder2", "granite", "mistral")
MOE = ("mixtral", "deepseek_v3")
CP = ("llama", "qwen3")
INDUCTOR = ("llama", "qwen3", "gpt2", "phi3")
AOT = [{"mode": "blocks", "backend": "aot_eager"}, {"mode": "model", "backend": "aot_eager"}]
INDUCTOR_SPECS = [{"mode": "blocks", "backend": "inductor"}]
EXTRA = {"ep2": {"ep": 2, "tp": 2, "pp": 1, "expert_parallel": True}, "cp2": {"cp": 2, "tp": 2, "pp": 1}}
TYPED = ("CompileError", "Refused", "NotSupported", "PlanSchemaError", "MeshError", "PipelineError")


def plan_for(family: str, mesh: str):
    if mesh in EXTRA:
        model, _ = plan_case(family, "tp4", "default")   # the captured model at its real shape
        plan = plan_cluster(model, 4, hardware="h100_sxm", batch=(8, seq_len(model)), constraints=EXTRA[mesh],
                            dtype=torch.float32)
        return model, plan
    return plan_case(family, mesh, "default")


def rows_for(family: str, mesh: str, specs: list, pool, one_device: bool = False) -> list[dict]:
    t0 = time.perf_counter()
    base = {"family": family, "mesh": mesh}
    try:
        model, plan = plan_for(family, mesh)
        recipe = small_recipe(family, model, [d for d in plan.mesh["shape"] if d > 1])
    except AutoplanError as exc:
        return [dict(base, setting="-", outcome="NOT PLANNED", detail=f"{type(exc).__name__}: {exc}"[:200])]
    pipe = plan.pipeline or {}
    rows = PIPELINED[mesh]["dp"] * int(pipe.get("microbatches", 1)) if mesh in PIPELINED else 4
    result = check_compiled(plan, recipe, specs, pool=pool, global_batch=rows, one_device=one_device)
    seconds = time.perf_counter() - t0
    if result.error:
        return [dict(base, setting="-", outcome="CRASH", detail=result.error[-300:], seconds=seconds)]
    out = []
    for name, r in result.settings.items():
        if name in ("eager", "one_device") and not r.get("error"):
            continue
        row = dict(base, setting=name, seconds=seconds)
        if r.get("error"):
            typed = any(t in r["error"].split(":")[0] for t in TYPED)
            out.append(dict(row, outcome="REFUSED" if typed else "CRASH", detail=r["error"][:300]))
            continue
        stats = r["stats"]
        row.update(loss_rel=r["loss_rel"], param_mean_abs=r["param_mean_abs"], graphs=stats.get("graphs"),
                   graph_breaks=stats.get("graph_breaks"))
        if "one_device_off" in r:
            ok = r["one_device_loss_rel"] <= 1e-4 and not r["one_device_off"]
            row.update(one_device_loss_rel=r["one_device_loss_rel"],
                       detail=f"vs one device: {len(r['one_device_off'])} params off" +
                       (f" ({', '.join(r['one_device_off'][:3])})" if r["one_device_off"] else ""))
        else:
            ok = r["loss_rel"] <= 1e-6 and r["param_mean_abs"] <= 1e-8
            row["detail"] = ""
        if name.startswith("blocks") and stats.get("graph_breaks"):
            ok = False
            row["detail"] += f" {stats['graph_breaks']} graph breaks in blocks"
        out.append(dict(row, outcome="EQUAL" if ok else "WRONG"))
    return out


def write(rows: list[dict], families: tuple, seconds: float) -> pd.DataFrame:
    """The table so far (written after every case, so a long run leaves its rows if cut short)."""
    frame = pd.DataFrame(rows)
    csv = OUT / "compile_corpus.csv"
    if tuple(families) != FAMILIES and csv.exists():
        old = pd.read_csv(csv, keep_default_na=False)
        frame = pd.concat([old[~old["family"].isin(families)], frame])
    order = {f: i for i, f in enumerate(FAMILIES)}
    frame = frame.sort_values("family", key=lambda c: c.map(lambda f: order.get(f, math.inf)),
                              kind="stable").reset_index(drop=True)
    frame.to_csv(csv, index=False)
    counts = frame["outcome"].value_counts().to_dict()
    cols = [c for c in ("family", "mesh", "setting", "outcome", "loss_rel", "param_mean_abs", "one_device_loss_rel",
                        "graphs", "graph_breaks", "detail") if c in frame]
    lines = ["# Compiled plans train as eager: the model corpus under torch.compile", "",
             "Regenerate: `PYTHONPATH=. nice .venv/bin/python benchmarks/compile_corpus.py [family ...]` "
             f"(last run: {len(rows)} rows in {seconds:.0f} s on this 2-core CPU, 4 gloo ranks).", "",
             "Each plan (the corpus's, at its real shape) runs on its family's small copy for 3 AdamW steps: eager, "
             "then compiled per block (`blocks`) and whole (`model`) with `aot_eager` -- equal means losses within "
             "rtol 1e-6 and parameters after the steps within mean |d| 1e-8 of eager, and 0 graph breaks inside a "
             "block; `blocks/inductor` rows are compared with one device (losses and every parameter rtol 1e-4). "
             "`model` under FSDP counts torch's graph breaks at FSDP's hooks (each FSDP unit is its own graph).", "",
             "Outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             frame[cols].to_markdown(index=False, floatfmt=".2e")]
    (OUT / "compile_corpus.md").write_text("\n".join(lines) + "\n")
    return frame


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.ERROR)
    families = tuple(argv) or FAMILIES
    t0 = time.perf_counter()
    rows: list[dict] = []
    with RankPool(4, timeout_s=1800, pg_timeout_s=1800) as pool:
        for family in families:
            cases = [(m, AOT, False) for m in ("tp4", "dp2_tp2", "pp2_tp2")]
            cases += [("ep2", AOT, False)] if family in MOE else []
            cases += [("cp2", AOT, False)] if family in CP else []
            cases += [("tp4", INDUCTOR_SPECS, True)] if family in INDUCTOR else []
            for mesh, specs, one in cases:
                for r in rows_for(family, mesh, specs, pool, one_device=one):
                    rows.append(r)
                    print(f"{family:12s} {mesh:8s} {r['setting']:18s} {r['outcome']:8s} "
                          f"loss {r.get('loss_rel', float('nan')):.2e} params {r.get('param_mean_abs', float('nan')):.2e} "
                          f"graphs {r.get('graphs')} breaks {r.get('graph_breaks')} {r.get('detail', '')[:150]}",
                          flush=True)
                frame = write(rows, families, time.perf_counter() - t0)
    bad = frame[~frame["outcome"].isin(["EQUAL", "REFUSED", "NOT PLANNED"])]
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
