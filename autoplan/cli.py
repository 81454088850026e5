"""The ``autoplan`` command line. Each subcommand returns an exit code; errors print one line."""
from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("autoplan")


def _cmd_demo(args) -> int:
    from autoplan.demo import run_demo

    print(f"autoplan demo: {args.world} gloo ranks on this CPU, plan '{args.plan}' on a small Llama")
    res = run_demo(world=args.world, plan_name=args.plan, steps=args.steps)
    print("\nPlan (one row per unit; cost predicted on this host's CPU profile):")
    print(res.plan.to_string(index=False, float_format=lambda v: f"{v:.2e}"))
    for pattern, spec in res.plan.attrs.get("styles", {}).items():
        print(f"  {pattern:28s} {spec['style']} {spec['args'] or ''}")
    for note in res.notes:
        print(f"note: {note}")
    print("\nTraining steps (one device vs tensor parallel):")
    print(res.steps.to_string(index=False, float_format=lambda v: f"{v:.6f}"))
    ok = res.max_rel_diff <= 1e-5
    print(f"\nmax relative loss difference: {res.max_rel_diff:.2e} -> {'EQUAL' if ok else 'DIFFERENT'} (rtol 1e-5)")
    if res.predicted_step_s is not None:
        print(f"step time: predicted {res.predicted_step_s * 1e3:.1f} ms, measured {res.measured_step_s * 1e3:.1f} ms "
              f"(median after the first step)")
    return 0 if ok else 1


def _parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """"dp=64,tp=8" -> ((64, 8), ("dp", "tp"))."""
    names, shape = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit():
            raise ValueError(f"--mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...], e.g. dp=64,tp=8")
        names.append(name.strip())
        shape.append(int(size))
    return tuple(shape), tuple(names)


def _load_model(spec: str, layers: int | None):
    """A preset name, or a path to an HF config.json (built on meta)."""
    import json
    from pathlib import Path

    from autoplan.presets import build_preset

    path = Path(spec)
    if path.suffix == ".json" and path.exists():
        import torch
        import transformers

        cfg = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        if layers:
            cfg.num_hidden_layers = layers
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return build_preset(spec, num_layers=layers)


def _cmd_plan(args) -> int:
    from autoplan import MeshSpec, autoplan

    shape, names = _parse_mesh(args.mesh)
    model = _load_model(args.model, args.layers)
    plan = autoplan(model, MeshSpec(shape, names, args.hardware), batch=(args.batch, args.seq))
    plan.model["source"] = args.model
    if args.layers:
        plan.model["layers_override"] = args.layers
    if args.output:
        plan.to_json(args.output)
        print(f"wrote {args.output}")
    _print_plan(plan)
    return 0


def _print_plan(plan) -> None:
    print(plan)
    cols = ["unit", "count", "strategy", "stream", "compute_s", "comm_s", "memory_bytes"]
    print(plan.summary()[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    mem = plan.predictions["memory_bytes"]
    print("memory per rank (GiB): " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in mem.items()))
    print("styles:")
    for pattern, spec in plan.styles.items():
        print(f"  {pattern:36s} {spec['style']} {spec['args'] or ''}")
    for note in plan.notes:
        print(f"note: {note}")


def _cmd_show(args) -> int:
    from autoplan import Plan

    _print_plan(Plan.from_json(args.plan))
    return 0


def _cmd_verify(args) -> int:
    from autoplan import Plan
    from autoplan.verify import verify

    plan = Plan.from_json(args.plan)
    source = args.model or plan.model.get("source")
    if not source:
        raise ValueError("verify: the plan does not record its model; pass --model PRESET")
    model = _load_model(source, args.layers or plan.model.get("layers_override"))
    result = verify(plan, model)
    print(result.collectives.to_string(index=False))
    print(f"parameter bytes per rank: predicted {result.param_bytes['predicted']:,} issued "
          f"{result.param_bytes['issued']:,}")
    print("PASS: predicted == issued" if result.passed else "FAIL: predictions differ from the runtime")
    return 0 if result.passed else 1


def _cmd_cost_models(args) -> int:
    from cost_models.cli import main as cost_main

    return cost_main([args.command, *args.rest])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoplan", description="Automatic parallelization plans for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan, apply and train a small Llama on 4 CPU ranks")
    d.add_argument("--world", type=int, default=4)
    d.add_argument("--plan", default="auto", help="'auto' (autoplan) or an expert plan name (torchtitan, megatron, ...)")
    d.add_argument("--steps", type=int, default=5)
    d.set_defaults(func=_cmd_demo)
    pl = sub.add_parser("plan", help="plan a preset or an HF config.json for a mesh")
    pl.add_argument("model", help="preset name (see autoplan.presets.list_presets) or path to an HF config.json")
    pl.add_argument("--mesh", required=True, help="e.g. dp=64,tp=8")
    pl.add_argument("--hardware", default="h100_sxm")
    pl.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
    pl.add_argument("--seq", type=int, required=True, help="sequence length")
    pl.add_argument("--layers", type=int, default=None, help="override the number of layers")
    pl.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    pl.set_defaults(func=_cmd_plan)
    sh = sub.add_parser("show", help="print a plan file")
    sh.add_argument("plan")
    sh.set_defaults(func=_cmd_show)
    ve = sub.add_parser("verify", help="dry-run a plan at its world size and compare collectives")
    ve.add_argument("plan")
    ve.add_argument("--model", default=None, help="preset/config (default: the one recorded in the plan)")
    ve.add_argument("--layers", type=int, default=None)
    ve.set_defaults(func=_cmd_verify)
    for name in ("profile", "calibrate", "hardware"):
        c = sub.add_parser(name, help=f"cost_models {name} (see: autoplan {name} -h)", add_help=False)
        c.add_argument("rest", nargs=argparse.REMAINDER)
        c.set_defaults(func=_cmd_cost_models)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except Exception as e:  # noqa: BLE001 - the CLI's contract: one line, non-zero exit
        if args.verbose:
            raise
        print(f"autoplan {args.command}: error: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
