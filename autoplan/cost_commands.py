"""The cost model's commands: hardware profiles, op profiling, collective calibration.

    autoplan hardware [NAME]
    autoplan profile --model llama3-8b --batch 1 --seq 256 [--device cpu] [--out ops.csv]
    autoplan profile --kernels --preset gpt-oss-20b --seq 4096 --ep 8 --hardware h100_sxm \
        --device cuda [--out kernels.csv] [--write-profile h100_measured.json]
    autoplan calibrate --world 2 [--out DIR]
    autoplan runtime --world 4     # eager-rank costs the planner uses on the cpu profile

``autoplan`` forwards these command lines here whole. They live in autoplan, not in cost_models,
because profiling a model needs the planner's models, presets and cluster search, and the cost
model sits below the planner. Profiles are merged into the on-disk ProfileTable of the device
(``$AUTOPLAN_CACHE_DIR`` or ~/.cache/autoplan); calibration writes the fitted link into the cached
``cpu`` hardware profile when run on CPU.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import pandas as pd

from autoplan.capture import capture
from autoplan.models.llama import LlamaConfig, build_llama
from autoplan.models.llama_ops import llama_model_ops
from autoplan.presets import build_preset, use_fused_attention
from autoplan.search.mesh.search import ClusterSearch
from autoplan.search.pricing.kernels import priced_kernels
from cost_models.calibrate import calibrate_collectives
from cost_models.chain_timing import profile_chains
from cost_models.fusion import fuse
from cost_models.hardware import list_hardware, load_hardware
from cost_models.hardware.host import save_host_profile
from cost_models.kernel_efficiency import measure, with_measured
from cost_models.profile_table import ProfileTable, device_key
from cost_models.profiler import TimingConfig, profile_ops
from cost_models.runtime import _path, calibrate_runtime

log = logging.getLogger(__name__)

# Llama-3 flavours (torchtitan, shared/reference/expert_plans.json) and a tiny one for smoke runs
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                      ffn_hidden=LlamaConfig.ffn_hidden_for(4096, 1024, 1.3)),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                       ffn_hidden=LlamaConfig.ffn_hidden_for(8192, 4096, 1.3)),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                        ffn_hidden=LlamaConfig.ffn_hidden_for(16384, 4096, 1.2)),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoplan-cost", description="cost_models: profile ops, calibrate collectives")
    sub = ap.add_subparsers(dest="cmd", required=True)
    hw = sub.add_parser("hardware", help="list hardware profiles or show one")
    hw.add_argument("name", nargs="?")
    hw.add_argument("--remeasure", action="store_true", help="re-measure the cpu profile")

    pr = sub.add_parser("profile", help="time the distinct ops of a model on this device")
    pr.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    pr.add_argument("--batch", type=int, default=1)
    pr.add_argument("--seq", type=int, default=256)
    pr.add_argument("--dtype", default="float32")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--layers", type=int, help="override the preset's layer count (counts only)")
    pr.add_argument("--rounds", type=int, default=1)
    pr.add_argument("--threads", type=int, help="torch intra-op threads (cpu)")
    pr.add_argument("--forward-only", action="store_true")
    pr.add_argument("--out", type=Path, help="also write the rows to this CSV")
    pr.add_argument("--no-save", action="store_true", help="do not merge into the device's profile table")
    pr.add_argument("--no-chains", action="store_true",
                    help="skip timing the elementwise chains eager and compiled (cpu)")
    pr.add_argument("--kernels", action="store_true",
                    help="measure the GEMM, grouped-GEMM and attention kernels a plan of --preset prices, at its "
                         "shapes, beside the --hardware profile's prediction")
    pr.add_argument("--preset", default="gpt-oss-20b", help="(--kernels) an autoplan preset (autoplan.presets)")
    pr.add_argument("--tp", type=int, default=1, help="(--kernels) tensor-parallel degree of the plan")
    pr.add_argument("--ep", type=int, default=1, help="(--kernels) expert-parallel degree of the plan")
    pr.add_argument("--hardware", default=None, help="(--kernels) the profile to compare with: a name or a JSON file")
    pr.add_argument("--write-profile", type=Path, default=None,
                    help="(--kernels) write --hardware with the measured kernels as its kernel points (JSON)")

    ca = sub.add_parser("calibrate", help="benchmark collectives on gloo ranks and fit alpha/beta")
    ca.add_argument("--world", type=int, default=2)
    ca.add_argument("--reps", type=int, default=10)
    ca.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter,all_to_all,send_recv")
    ca.add_argument("--max-bytes", type=int, default=1 << 24)
    ca.add_argument("--out", type=Path, help="folder for collectives_fit.csv and collectives_points.csv")
    ca.add_argument("--no-save", action="store_true", help="do not write the link into the cpu profile")

    rt = sub.add_parser("runtime", help="measure per-op, DTensor, GEMM and gloo costs on concurrent ranks")
    rt.add_argument("--world", type=int, default=4)
    rt.add_argument("--reps", type=int, default=20)
    rt.add_argument("--no-save", action="store_true", help="print only; do not cache for the planner")
    return ap


def _hardware(args) -> int:
    if not args.name:
        rows = []
        for name in list_hardware():
            if name == "cpu" and not args.remeasure:
                rows.append({"name": "cpu", "bf16_TFLOPs": None, "hbm_TBps": None, "memory_GiB": None,
                             "per_node": 1, "intra_GBps": None, "inter_GBps": None})
                continue
            h = load_hardware(name, remeasure=args.remeasure)
            rows.append({"name": name, "bf16_TFLOPs": h.peak("bf16") / 1e12, "hbm_TBps": h.memory_bandwidth / 1e12,
                         "memory_GiB": h.memory_capacity / 2**30, "per_node": h.devices_per_node,
                         "intra_GBps": h.intra_node.bandwidth / 1e9, "inter_GBps": h.inter_node.bandwidth / 1e9})
        print(pd.DataFrame(rows).to_string(index=False))
        return 0
    h = load_hardware(args.name, remeasure=args.remeasure)
    print(pd.Series(h.to_dict(), dtype=object).to_string())
    return 0


def _kernels(args) -> int:
    import json

    import torch
    from tqdm import tqdm

    if not args.hardware:
        raise SystemExit("autoplan profile --kernels: --hardware is required (the profile the measurements "
                         f"are compared with and written into; known: {list_hardware()} or a JSON file)")
    hw = load_hardware(args.hardware)
    model = use_fused_attention(build_preset(args.preset, num_layers=args.layers))
    search = ClusterSearch.of(model, max(args.ep, 1) * max(args.tp, 1), hardware=args.hardware, batch=(args.batch, args.seq),
                           microbatch_sizes=(args.batch,), dtype=torch.bfloat16)
    shapes = priced_kernels(search, b=args.batch, tp=args.tp, ep=args.ep, note=args.preset)
    with tqdm(total=len(shapes), desc=f"kernels of {args.preset}", unit="kernel") as bar:
        frame = measure(shapes, hw, device=args.device, progress=lambda s: bar.update(1))
    cols = ["kind", "m", "n", "k", "groups", "span", "measured_s", "predicted_s", "measured_eff", "predicted_eff",
            "error"]
    print(frame[cols].to_string(index=False))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
        print(f"rows written to {args.out}")
    if args.write_profile:
        name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else device_key(args.device)
        measured = with_measured(hw, frame, f"autoplan profile --kernels --preset {args.preset} on {name} "
                                            f"(torch {torch.__version__}): forward + backward, median")
        args.write_profile.parent.mkdir(parents=True, exist_ok=True)
        args.write_profile.write_text(json.dumps(measured.to_dict(), indent=2) + "\n")
        print(f"profile with {len(measured.efficiency.kernels)} measured kernels: {args.write_profile}")
    return 0 if (frame["error"] == "").all() else 1


def _profile(args) -> int:
    import torch
    from tqdm import tqdm

    if args.kernels:
        return _kernels(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(PRESETS[args.model])
    if args.layers:
        cfg["n_layers"] = args.layers
    t0 = time.perf_counter()
    specs = llama_model_ops(args.batch, args.seq, args.dtype, backward=not args.forward_only, **cfg)
    timing = TimingConfig(warmup=1, min_reps=3, max_reps=20, budget_s=0.02, slow_op_s=0.3, slow_reps=2,
                          rounds=args.rounds)
    with tqdm(total=len(specs) * timing.rounds, desc=f"profile {args.model}", unit="op") as bar:
        frame = profile_ops(specs, device=args.device, cfg=timing, progress=lambda s: bar.update(1))
    elapsed = time.perf_counter() - t0
    frame["total_s"] = frame["time_s"] * frame["count"]
    print(frame.sort_values("total_s", ascending=False).head(15)[["op", "phase", "count", "time_s", "total_s"]]
          .to_string(index=False))
    failed = frame[frame["error"] != ""]
    print(f"\n{len(specs)} distinct ops, {len(failed)} failed, profiled in {elapsed:.1f} s; "
          f"sum over one step (count x time): {frame['total_s'].sum():.2f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
        print(f"rows written to {args.out}")
    if not args.no_save:
        key = device_key(args.device)
        path = ProfileTable.load(key).update(frame).save()
        print(f"profile table {key}: {path}")
    if torch.device(args.device).type == "cpu" and not args.no_chains:
        _chains(args, cfg)
    return 0 if failed.empty else 1


def _chains(args, cfg: dict) -> None:
    """The model's elementwise chains timed eager and compiled on this host (cost_models.chain_timing);
    the fitted cost of a compiled kernel goes into the cpu profile, which prices compiled plans."""
    graph = capture(build_llama(device="meta", **cfg), batch=(args.batch, args.seq))
    rows, host = profile_chains(graph.nodes, fuse(graph.nodes, "blocks"), load_hardware("cpu"))
    print(rows.to_string(index=False))
    print(f"compiled kernel: {host.efficiency.fused_kernel_overhead * 1e6:.1f} us beyond its bytes")
    if args.out:
        rows.to_csv(args.out.with_name(args.out.stem + "_chains.csv"), index=False)
    if not args.no_save:
        print(f"cpu profile: {save_host_profile(host)}")


def _calibrate(args) -> int:
    from tqdm import tqdm

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    sizes = [2 ** k for k in range(10, args.max_bytes.bit_length())]
    with tqdm(total=len(kinds), desc=f"calibrate {args.world} ranks", unit="kind") as bar:
        fits, points, link = calibrate_collectives(args.world, kinds, sizes, args.reps,
                                                   progress=lambda k: (bar.set_postfix_str(k), bar.update(1)))
    show = fits.assign(alpha_us=fits["alpha_s"] * 1e6, GBps=fits["bandwidth_Bps"] / 1e9,
                       heldout_mape_pct=fits["heldout_mape"] * 100)
    print(show[["kind", "group_size", "alpha_us", "GBps", "heldout_mape_pct"]].to_string(index=False))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        fits.to_csv(args.out / "collectives_fit.csv", index=False)
        points.to_csv(args.out / "collectives_points.csv", index=False)
    if not args.no_save:
        host = load_hardware("cpu")
        path = save_host_profile(host.with_overrides(intra_node=link, inter_node=link))
        print(f"cpu profile links set to alpha {link.latency * 1e6:.1f} us, {link.bandwidth / 1e9:.2f} GB/s: {path}")
    return 0


def _runtime(args) -> int:
    import json

    rt = calibrate_runtime(args.world, reps=args.reps, save=not args.no_save)
    print(json.dumps(rt.to_dict(), indent=1))
    if not args.no_save:
        print(f"saved: {_path(args.world)} (and the link into the cpu profile)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return {"hardware": _hardware, "profile": _profile, "calibrate": _calibrate, "runtime": _runtime}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
