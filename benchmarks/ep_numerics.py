"""Expert parallel numerics beyond the test slice, on 8 gloo ranks: plans from the planner
(plan_mesh on a fixed mesh, plan_cluster for pipelined ones), applied with plan.apply, one SGD
step compared with one device -- loss (rtol 1e-5), every gradient and every updated parameter
(rtol 1e-4 / atol 1e-6). Cases the tests leave out for time: uneven experts (6 over ep=4: one rank
holds none) with FSDP and inside a pipeline, ep=4 x pp=2, ep with a tp dimension, every schedule
kind (ZeroBubble, 1F1B with full recomputation, Interleaved1F1B, ZBV).
Writes benchmarks/results/ep_numerics.csv and .md.

    PYTHONPATH=. .venv/bin/python benchmarks/ep_numerics.py
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from autoplan import plan_cluster
from autoplan.mesh_plan import plan_mesh
from autoplan.request import PlanRequest
from hyper_parallel import ParallelDims
from hyper_parallel.local import RankPool
from tests.planner import ep_plan_workers
from tests.runtime.ep_workers import build
from tests.search_pp.ep_workers import run_ep_pipeline

OUT = Path(__file__).parent / "results"
BATCH, SEQ = 8, 8
# (model[:experts], mesh) for one stage; (model[:experts], constraints) for pipelines
ONE_STAGE = [("mixtral:6", (2, 4)), ("qwen3_moe:6", (2, 4))]
PIPELINED = [("mixtral", {"dp": 1, "ep": 4, "pp": 2, "tp": 1}),
             ("mixtral:6", {"dp": 1, "ep": 4, "pp": 2, "tp": 1}),
             ("qwen3_moe", {"dp": 1, "ep": 2, "pp": 2, "tp": 2}),
             ("qwen3_moe", {"dp": 2, "ep": 2, "pp": 2, "tp": 1, "schedule": "1F1B", "activation_checkpointing": True}),
             ("mixtral", {"dp": 2, "ep": 2, "pp": 2, "tp": 1, "schedule": "Interleaved1F1B"}),
             ("qwen3_moe:6", {"dp": 1, "ep": 4, "pp": 2, "tp": 1, "schedule": "ZBV"})]


def _model(spec: str):
    name, _, n = spec.partition(":")
    return build(name, n_experts=int(n or 8))[0]


def main() -> int:
    rows = []
    pool = RankPool(8, timeout_s=600)
    try:
        for spec, shape in ONE_STAGE:
            plan = plan_mesh(_model(spec), ParallelDims(shape, ("dp", "ep"), hardware="cpu"),
                             PlanRequest.for_mesh("plan_mesh", hardware="cpu", batch=(BATCH, SEQ), dtype=torch.float32,
                                                  expert_parallel=True, fsdp=True))
            t = time.perf_counter()
            reps = pool.run(ep_plan_workers.run_all, [("case", plan.to_json(), spec, BATCH)])
            rows += _rows(spec, plan, [r["case"] for r in reps], time.perf_counter() - t)
        for spec, cons in PIPELINED:
            model = _model(spec).to("meta")
            plan = plan_cluster(model, 8, hardware="cpu", batch=(BATCH, SEQ), devices_per_node=8,
                                constraints=dict(cons, fsdp=True, expert_parallel=True, microbatch_size=1))
            t = time.perf_counter()
            reps = pool.run(run_ep_pipeline, [(plan.to_json(), spec)])
            rows += _rows(spec, plan, [next(iter(r.values())) for r in reps], time.perf_counter() - t)
    finally:
        pool.close()
    df = pd.DataFrame(rows)
    OUT.mkdir(exist_ok=True)
    df.to_csv(OUT / "ep_numerics.csv", index=False)
    (OUT / "ep_numerics.md").write_text(
        "# Expert parallel numerics on 8 gloo ranks (benchmarks/ep_numerics.py)\n\n"
        "One SGD step of a planned and applied plan against one device; every rank's loss, gradients and "
        "parameters checked (`ok`: loss rtol 1e-5, every gradient and parameter rtol 1e-4 / atol 1e-6).\n\n"
        + df.to_markdown(index=False) + "\n")
    print(df.to_string())
    return 0 if bool(df["ok"].all()) else 1


def _rows(spec: str, plan, reports: list[dict], seconds: float) -> list[dict]:
    mesh = " x ".join(f"{n}{s}" for n, s in zip(plan.mesh["names"], plan.mesh["shape"]) if s > 1)
    pipe = plan.pipeline or {}
    errors = [r.get("error", "") for r in reports if "error" in r]
    good = [r for r in reports if "error" not in r]
    worst = max((abs(r["par"] - r["ref"]) / abs(r["ref"]) for r in good), default=float("nan"))
    ok = not errors and all(not r["bad_grads"] and not r["bad_params"] for r in good) and worst <= 1e-5
    return [{"model": spec, "mesh": mesh, "schedule": pipe.get("schedule", "-") if int(pipe.get("pp", 1)) > 1 else "-",
             "fsdp": bool(plan.fsdp.get("enabled")), "recompute": plan.recompute_mode,
             "expert_styles": ";".join(f"{k}={v['args']}" for k, v in plan.parallel["ep"]["styles"].items()),
             "loss_rel_err": worst, "ok": ok, "error": errors[0][-300:] if errors else "", "seconds": round(seconds, 1)}]


if __name__ == "__main__":
    raise SystemExit(main())
