"""Long context on H100s: Llama-3-8B and Llama-3-405B at 128K tokens per sequence, planned with cp.

For each model autoplan prices every (dp x) cp x tp mesh of a device count -- the splits
``autoplan.context_search.plan_context`` searches (``context_meshes``), each by ``autoplan`` on the
fixed mesh: activations per rank / cp, attention at 1/cp of the causal work, the ring or all-gather
exchange on the cp link) and the cheapest plan that fits memory is the choice. The 405B published
long-context layout (Llama 3 paper: TP8 CP16 PP16, DP4 on 8,192 GPUs) has a pipeline, which this
planner does not combine with cp yet; it is priced beside the choice as an *estimate*: one
pipeline stage (8 of 126 layers, embedding and head included) planned by autoplan on dp4 x cp16 x tp8
for the whole step's batch, times the 1F1B bubble factor 1 + (pp-1)/m (m = 32 micro-batches of one
sequence per dp rank), activations of pp in-flight micro-batches. Writes
benchmarks/results/long_context.md.

    .venv/bin/python benchmarks/long_context.py [--layers-405b 126]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from autoplan import MeshSpec, autoplan
from autoplan.context_search import context_meshes
from autoplan.errors import InfeasiblePlanError
from autoplan.presets import build_preset
from autoplan.verify import verify

OUT = Path(__file__).parent / "results" / "long_context.md"
SEQ = 131072
GiB = 2**30


def _row(label, spec_shape, names, plan=None, seconds=0.0, why=""):
    mesh = " x ".join(f"{n}{s}" for n, s in zip(names, spec_shape))
    if plan is None:
        return f"| {label} | {mesh} | - | - | no | - | - | {seconds:.1f} | {why} |"
    cp = plan.parallel.get("cp") or {}
    mem = plan.predictions["memory_bytes"]["total"] / GiB
    return (f"| {label} | {mesh} | {plan.predictions['step_s']:.3f} | {mem:.1f} | yes | {cp.get('variant', '-')} "
            f"| {cp.get('exposed_s', 0.0):.4f} / {cp.get('exchange_s', 0.0):.4f} | {seconds:.1f} | "
            f"ac={plan.parallel['ac']['mode']}, stream {plan.stream_layout} |")


def _meshes(splits):
    """(shape, names) of (dp, cp, tp) splits, size-1 dimensions left out (as plan_context does)."""
    out = []
    for split in splits:
        kept = [(s, n) for s, n in zip(split, ("dp", "cp", "tp")) if s > 1]
        out.append((tuple(s for s, _ in kept), tuple(n for _, n in kept)))
    return out


def sweep(model, meshes, batch):
    """(rows, best plan) over ``meshes`` [(shape, names)]: autoplan on each; the fastest that fits."""
    rows, best = [], None
    for shape, names in meshes:
        t = time.perf_counter()
        try:
            plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=batch)
        except InfeasiblePlanError as e:
            rows.append(_row("", shape, names, None, time.perf_counter() - t, str(e).split(";")[0][:90]))
            continue
        rows.append(_row("", shape, names, plan, time.perf_counter() - t))
        if best is None or plan.predictions["step_s"] < best.predictions["step_s"]:
            best = plan
    return rows, best


HEADER = ("| | mesh | step_s | GiB/rank | fits | cp variant | cp exposed / exchange s | plan s | notes |\n"
          "|:--|:--|--:|--:|:--|:--|--:|--:|:--|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers-405b", type=int, default=126)
    args = ap.parse_args(argv)
    out = ["# Long context: 128K tokens per sequence on H100s (h100_sxm profile)\n"]

    # Llama-3-8B on one node (8 GPUs), one sequence of 128K per step
    m8 = build_preset("titan-llama3-8b", max_seq_len=SEQ)
    rows8, best8 = sweep(m8, _meshes(context_meshes(8, (1, SEQ), 8)), (1, SEQ))   # every split (dp needs 8 seqs)
    out += ["## Llama-3-8B (32 layers), batch 1 x 131072, 8 GPUs\n", HEADER, *rows8]
    if best8 is not None:
        t = time.perf_counter()
        res = verify(best8, m8)
        out += ["", f"**autoplan's choice: {dict(zip(best8.mesh['names'], best8.mesh['shape']))}** "
                f"(step {best8.predictions['step_s']:.3f} s, {best8.predictions['memory_bytes']['total'] / GiB:.1f} "
                f"GiB/rank, {best8.parallel['cp']['variant'] if best8.parallel.get('cp') else 'no cp'}); "
                f"dry-run verify at world 8: passed={res.passed} ({time.perf_counter() - t:.1f} s)\n"]

    # Llama-3-405B at 8,192 GPUs (the published layout's count), global batch 128 x 128K (16M tokens)
    m405 = build_preset("titan-llama3-405b", num_layers=args.layers_405b, max_seq_len=SEQ)
    meshes405 = _meshes(context_meshes(8192, (128, SEQ), 8, tp=[8], cp=[16, 32, 64]))
    rows405, best405 = sweep(m405, meshes405, (128, SEQ))
    out += [f"## Llama-3-405B ({args.layers_405b} layers), batch 128 x 131072, 8,192 GPUs\n", HEADER, *rows405]

    # the published layout, estimated from one pipeline stage (see the module docstring)
    pp, dp, m = 16, 4, 128 // 4
    stage = build_preset("titan-llama3-405b", num_layers=8, max_seq_len=SEQ)
    t = time.perf_counter()
    sp = autoplan(stage, MeshSpec((dp, 16, 8), ("dp", "cp", "tp"), "h100_sxm"), batch=(128, SEQ),
                  activation_checkpointing=True)
    bubble = 1 + (pp - 1) / m
    mem = sp.predictions["memory_bytes"]
    act = mem["activations"] / m * pp
    est_mem = (mem["total"] - mem["activations"] + act) / GiB
    out += [f"| published TP8 CP16 PP16 DP4 (estimate) | pp16 x dp4 x cp16 x tp8 | "
            f"{sp.predictions['step_s'] * bubble:.3f} | {est_mem:.1f} | yes | {sp.parallel['cp']['variant']} | "
            f"{sp.parallel['cp']['exposed_s']:.4f} / {sp.parallel['cp']['exchange_s']:.4f} | "
            f"{time.perf_counter() - t:.1f} | one 8-layer stage x 1F1B bubble {bubble:.3f}; activations of {pp} "
            "in-flight micro-batches; p2p between stages not priced |"]
    if best405 is not None:
        out += ["", f"**autoplan's choice (no pipeline): {dict(zip(best405.mesh['names'], best405.mesh['shape']))}** "
                f"step {best405.predictions['step_s']:.3f} s vs the published layout's estimate "
                f"{sp.predictions['step_s'] * bubble:.3f} s\n"]

    # planning time at 16,384 GPUs
    t = time.perf_counter()
    p16 = autoplan(m405, MeshSpec((128, 16, 8), ("dp", "cp", "tp"), "h100_sxm"), batch=(128, SEQ))
    dt = time.perf_counter() - t
    out += [f"## Planning time: Llama-3-405B at 128K on 16,384 GPUs (dp128 x cp16 x tp8): **{dt:.1f} s** "
            f"(capture {p16.timing['capture_s']:.1f} s, probe {p16.timing['probe_s']:.1f} s); step "
            f"{p16.predictions['step_s']:.3f} s, {p16.predictions['memory_bytes']['total'] / GiB:.1f} GiB/rank, "
            f"{p16.parallel['cp']['variant']}\n",
            "Pricing (from the plans' notes): " + next(n for n in p16.notes if n.startswith("context parallel")) + "\n"]
    text = "\n".join(out)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
