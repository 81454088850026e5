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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoplan", description="Automatic parallelization plans for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan, apply and train a small Llama on 4 CPU ranks")
    d.add_argument("--world", type=int, default=4)
    d.add_argument("--plan", default="auto", help="'auto' (autoplan) or an expert plan name (torchtitan, megatron, ...)")
    d.add_argument("--steps", type=int, default=5)
    d.set_defaults(func=_cmd_demo)
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
