"""The ``autoplan`` command line. Each subcommand returns an exit code; errors print one line."""
from __future__ import annotations

import argparse
import logging
import sys

from autoplan.api import autoplan
from autoplan.demo import run_demo
from autoplan.errors import AutoplanError, InvalidArgumentError
from autoplan.models.llama_plans import EXPERT_PLANS
from autoplan.plan.plan import Plan
from autoplan.presets import build_preset
from autoplan import importers
from autoplan.review import (
    diff, plot_communication, plot_memory, plot_timeline, save_figure, to_hf_tp_plan, to_python, to_torch,
)
from autoplan.review.compare import compare_plans
from autoplan.review.report import write_report
from hyper_parallel.parallel_dims import ParallelDims, mesh_roles
from autoplan.train.cli import register as register_train
from autoplan.verify import verify
from autoplan.cost_commands import main as cost_main

log = logging.getLogger("autoplan")


def _cmd_demo(args) -> int:
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


def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (a batch, sequence, layer or device count of 0 plans nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """"dp=64,tp=8" -> ((64, 8), ("dp", "tp")); names from the mesh-name vocabulary."""
    names, shape = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise InvalidArgumentError(f"--mesh {text!r}: expected NAME=SIZE[,NAME=SIZE...] with sizes >= 1, "
                                       "e.g. dp=64,tp=8")
        names.append(name.strip())
        shape.append(int(size))
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"--mesh {text!r}: a dimension name is given twice")
    mesh_roles(names)  # MeshNameError for a name that does not say which parallelism it is
    return tuple(shape), tuple(names)


def _load_model(spec: str, layers: int | None):
    """A preset name, or a path to an HF config.json (built on meta)."""
    import json
    from pathlib import Path

    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        raise InvalidArgumentError(f"--layers {layers!r}: must be an integer >= 1")
    path = Path(spec)
    if path.suffix == ".json" and path.exists():
        import torch
        import transformers

        try:
            config = json.loads(path.read_text())
        except (ValueError, OSError) as e:
            raise InvalidArgumentError(f"{spec}: not a readable JSON config: {e}") from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise InvalidArgumentError(f"{spec}: an HF config.json needs a \"model_type\" (e.g. \"llama\"); "
                                       "this file has none")
        try:
            cfg = transformers.AutoConfig.for_model(**config)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{spec}: transformers cannot build model_type "
                                       f"{config['model_type']!r}: {e}") from None
        if layers is not None:
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                if hasattr(cfg, key):
                    setattr(cfg, key, layers)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return build_preset(spec, num_layers=layers)


EXPERT_STYLE_NAMES = ("torchtitan", "torchtitan_no_loss_parallel", "megatron", "megatron_loss_parallel", "hf")


def _load_styles(spec: str, model):
    """``--styles``: an expert plan name, or a JSON file of {pattern: style dict} or HF strings."""
    import json
    from pathlib import Path

    if spec == "hf":
        return importers.styles_from_hf(importers.load_reference("hf/llama")["tp_plan"],
                                        prefix="model." if hasattr(model, "model") else "")
    if spec in EXPERT_STYLE_NAMES:
        return {k: v.to_dict() for k, v in EXPERT_PLANS[spec]().items()}
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"--styles {spec!r}: neither a file nor one of {list(EXPERT_STYLE_NAMES)}")
    data = json.loads(path.read_text())
    data = data.get("tp_plan", data) if isinstance(data, dict) else data
    if all(isinstance(v, str) for v in data.values()):
        return importers.styles_from_hf(data, prefix="model." if hasattr(model, "model") else "")
    return importers.styles_from_expert(data, model=model)


def _mesh_candidates(args) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """--mesh as given, or for --devices N every dp x tp with tp in 1, 2, 4, 8 dividing N."""
    if args.mesh:
        return [_parse_mesh(args.mesh)]
    if not args.devices:
        raise ValueError("plan: give --mesh dp=D,tp=T or --devices N")
    return [((args.devices // tp, tp), ("dp", "tp")) for tp in (1, 2, 4, 8) if args.devices % tp == 0]


def _cmd_plan(args) -> int:
    from tqdm import tqdm

    meshes = _mesh_candidates(args)
    model = _load_model(args.model, args.layers)
    styles = _load_styles(args.styles, model) if args.styles else None
    if args.batch:
        batch = args.batch
    elif args.mesh:  # one sequence per data-parallel rank
        shape, names = meshes[0]
        dp_name = mesh_roles(names).get("dp")
        batch = dict(zip(names, shape)).get(dp_name, 1)
    else:
        batch = args.devices
    plans, failures = [], []
    for shape, names in tqdm(meshes, desc="planning meshes", unit="mesh", disable=len(meshes) == 1,
                             file=sys.stderr):
        try:
            plans.append(autoplan(model, ParallelDims(shape, names, args.hardware), batch=(batch, args.seq),
                                  styles=styles))
        except AutoplanError as e:
            failures.append(f"{dict(zip(names, shape))}: {str(e).splitlines()[0]}")
    if not plans:
        raise ValueError("no mesh admits a plan: " + "; ".join(failures))
    plan = min(plans, key=lambda p: p.step_time)
    if len(plans) > 1:
        names = ["x".join(f"{n}{s}" for n, s in zip(p.mesh["names"], p.mesh["shape"])) for p in plans]
        table = compare_plans(plans, names)[["step_s", "vs_best", "comm_s", "mem_total_gib", "tokens_per_s"]]
        print(table.to_string(float_format=lambda v: f"{v:.4g}"))
        for f in failures:
            print(f"skipped {f}")
    recorded = {"source": args.model}
    if styles is not None:
        recorded["plan_name"] = args.styles
    if args.layers is not None:  # recorded, so verify rebuilds the same depth
        recorded["layers_override"] = args.layers
    plan = plan.replace(model=dict(plan.model, **recorded))
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
    _print_plan(Plan.from_json(args.plan))
    return 0


def _cmd_verify(args) -> int:
    plan = Plan.from_json(args.plan)
    source = args.model or plan.model.get("source")
    if not source:
        raise ValueError("verify: the plan does not record its model; pass --model PRESET")
    model = _load_model(source, args.layers if args.layers is not None else plan.model.get("layers_override"))
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise InvalidArgumentError(f"verify: {type(model).__name__} is an encoder-decoder model; the dry run feeds "
                                   "decoder-only token inputs and cannot run it (plan, show, explain and export work)")
    result = verify(plan, model, numerics=args.numerics)
    if result.error:
        print(f"the plan does not run in the dry run: {result.error}")
    else:
        print(result.collectives.to_string(index=False))
        print(f"parameter bytes per rank: predicted {result.param_bytes['predicted']:,} issued "
              f"{result.param_bytes['issued']:,}")
    if result.numerics is not None:
        print(f"numerics on a small copy: {result.numerics.summary()}")
    if result.async_tp is not None:
        print(result.async_tp if isinstance(result.async_tp, str) else result.async_tp.summary())
    print("PASS: predicted == issued" + (" and numerics equal one device" if args.numerics else "")
          if result.passed else "FAIL: see above")
    return 0 if result.passed else 1


def _cmd_diff(args) -> int:
    frame = diff(Plan.from_json(args.a), Plan.from_json(args.b))
    if frame.empty:
        print("plans are identical")
        return 0
    print(frame.to_string(index=False, max_colwidth=args.width))
    print(f"{len(frame)} differences")
    return 1 if args.exit_code else 0


def _cmd_compare(args) -> int:
    from pathlib import Path

    if len(args.plans) < 1:
        raise ValueError("compare: give one or more plan files")
    names = args.names.split(",") if args.names else [Path(p).stem for p in args.plans]
    frame = compare_plans([Plan.from_json(p) for p in args.plans], names, strategies=args.strategies)
    if args.csv:
        frame.to_csv(args.csv)
        print(f"wrote {args.csv}")
    print(frame.T.to_string(float_format=lambda v: f"{v:.4g}"))
    return 0


def _cmd_explain(args) -> int:
    print(Plan.from_json(args.plan).explain(args.module).text)
    return 0


def _cmd_export(args) -> int:
    import json

    plan = Plan.from_json(args.plan)
    if args.format == "json":
        text = plan.to_json()
    elif args.format == "python":
        text = to_python(plan)
    elif args.format == "hf":
        hf = to_hf_tp_plan(plan, version=args.hf_version)
        text = json.dumps({"tp_plan": hf.tp_plan, "base_model_tp_plan": hf.base_model_tp_plan,
                           "not_expressible": hf.not_expressible, "omitted": hf.omitted}, indent=1) + "\n"
    else:  # torch: the styles as torch objects (repr), for reading; apply them with to_torch in Python
        text = "".join(f"{k!r}: {v!r}\n" for k, v in to_torch(plan).items())
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    if args.format == "hf" and hf.not_expressible:
        print(f"note: {len(hf.not_expressible)} entries have no HF name (see not_expressible)", file=sys.stderr)
    return 0


def _cmd_plot(args) -> int:
    plan = Plan.from_json(args.plan)
    fig = {"memory": plot_memory, "communication": plot_communication, "timeline": plot_timeline}[args.kind](plan)
    print(f"wrote {save_figure(fig, args.output)}")
    return 0


def _cmd_report(args) -> int:
    from pathlib import Path

    names = args.names.split(",") if args.names else [Path(p).stem for p in args.plans]
    if len(names) != len(args.plans):
        raise InvalidArgumentError(f"report --names: {len(names)} names for {len(args.plans)} plan files")
    path = write_report([Plan.from_json(p) for p in args.plans], args.output, names, title=args.title)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB, self-contained: open it in any browser)")
    return 0


# commands whose command line autoplan.cost_commands parses (its options, its --help): forwarded whole
COST_COMMANDS = ("profile", "calibrate", "hardware", "runtime")


def _cmd_cost_models(args) -> int:
    return cost_main([args.command, *args.rest])


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block), as the CLI promises."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autoplan", description="Automatic parallelization plans for PyTorch.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="plan, apply and train a small Llama on 4 CPU ranks")
    d.add_argument("--world", type=_positive, default=4)
    d.add_argument("--plan", default="auto",
                   help="'auto' (autoplan) or an expert plan name (torchtitan, megatron, ...)")
    d.add_argument("--steps", type=_positive, default=5)
    d.set_defaults(func=_cmd_demo)
    pl = sub.add_parser("plan", help="plan a preset or an HF config.json for a mesh")
    pl.add_argument("model", help="preset name (see autoplan.presets.list_presets) or path to an HF config.json")
    pl.add_argument("--mesh", default=None, help="e.g. dp=64,tp=8")
    pl.add_argument("--devices", type=_positive, default=None, help="instead of --mesh: try dp x tp (tp 1..8), keep the best")
    pl.add_argument("--hardware", default="h100_sxm")
    pl.add_argument("--batch", type=_positive, default=None, help="global batch in sequences (default: one per dp rank)")
    pl.add_argument("--seq", type=_positive, default=4096, help="sequence length")
    pl.add_argument("--styles", default=None,
                    help="price a hand-written plan instead of solving: "
                         f"{', '.join(EXPERT_STYLE_NAMES)} or a JSON file")
    pl.add_argument("--layers", type=_positive, default=None, help="override the number of layers")
    pl.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    pl.set_defaults(func=_cmd_plan)
    sh = sub.add_parser("show", help="print a plan file")
    sh.add_argument("plan")
    sh.set_defaults(func=_cmd_show)
    ve = sub.add_parser("verify", help="dry-run a plan at its world size and compare collectives")
    ve.add_argument("plan")
    ve.add_argument("--model", default=None, help="preset/config (default: the one recorded in the plan)")
    ve.add_argument("--layers", type=_positive, default=None)
    ve.add_argument("--numerics", action="store_true",
                    help="also train one step of the plan on a small copy on local gloo ranks vs one device")
    ve.set_defaults(func=_cmd_verify)
    di = sub.add_parser("diff", help="differences between two plan files")
    di.add_argument("a")
    di.add_argument("b")
    di.add_argument("--exit-code", action="store_true", help="exit 1 when the plans differ (like git diff)")
    di.add_argument("--width", type=_positive, default=60, help="column width")
    di.set_defaults(func=_cmd_diff)
    co = sub.add_parser("compare", help="plan files side by side (step time, throughput, memory)")
    co.add_argument("plans", nargs="+")
    co.add_argument("--names", default=None, help="comma-separated names (default: file stems)")
    co.add_argument("--strategies", action="store_true", help="add one row per unit's strategy")
    co.add_argument("--csv", default=None, help="also write the table as CSV")
    co.set_defaults(func=_cmd_compare)
    ex = sub.add_parser("explain", help="why a module got its style: each alternative's cost")
    ex.add_argument("plan")
    ex.add_argument("module", help="module FQN (layers.3.attention.wq) or unit (head, layers/mlp)")
    ex.set_defaults(func=_cmd_explain)
    xp = sub.add_parser("export", help="a plan as JSON, torch styles, HF tp_plan strings or Python")
    xp.add_argument("plan")
    xp.add_argument("--format", choices=("json", "torch", "hf", "python"), default="python")
    xp.add_argument("--hf-version", choices=("v5", "v4"), default="v5")
    xp.add_argument("-o", "--output", default=None)
    xp.set_defaults(func=_cmd_export)
    pt = sub.add_parser("plot", help="save a plot of a plan as PNG")
    pt.add_argument("plan")
    pt.add_argument("kind", choices=("memory", "communication", "timeline"))
    pt.add_argument("-o", "--output", required=True)
    pt.set_defaults(func=_cmd_plot)
    rp = sub.add_parser("report", help="one self-contained HTML page of a plan, or a comparison of several")
    rp.add_argument("plans", nargs="+", help="plan JSON files (several: a comparison first)")
    rp.add_argument("-o", "--output", required=True, help="the HTML file to write")
    rp.add_argument("--names", default=None, help="comma-separated names (default: file stems)")
    rp.add_argument("--title", default=None)
    rp.set_defaults(func=_cmd_report)
    for name in COST_COMMANDS:   # listed for `autoplan --help`; main() forwards their command lines
        c = sub.add_parser(name, help=f"cost_models {name} (see: autoplan {name} -h)", add_help=False)
        c.add_argument("rest", nargs=argparse.REMAINDER)
        c.set_defaults(func=_cmd_cost_models)
    register_train(sub)
    return p


def _one_line(e: BaseException) -> str:
    """The first line of an error; for torch's CheckpointException (whose own first line lists only
    rank numbers) the first failing rank's error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = next(iter(failures.items()))
        inner = pair[0] if isinstance(pair, tuple) else pair
        return f"rank {rank}: {type(inner).__name__}: {_one_line(inner)}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COST_COMMANDS:
        # argparse's REMAINDER does not take a first argument that looks like an option, so
        # ``autoplan profile --model tiny`` would be refused before cost_models saw it
        try:
            return _one_line_errors(argv[0], lambda: cost_main(argv), verbose=False)
        except SystemExit as e:   # cost_models' --help (0), its parser's refusal (2) or a refusal in words
            if isinstance(e.code, int):
                return e.code
            print(e.code, file=sys.stderr)
            return 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad command line (2, one line already printed)
        return int(e.code or 0)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return _one_line_errors(args.command, lambda: args.func(args), verbose=args.verbose)


def _one_line_errors(command: str, run, verbose: bool) -> int:
    """``run()``'s exit code; an error it raises becomes one line on stderr and exit code 2 (the
    CLI's contract), unless ``verbose`` asks for the traceback."""
    try:
        return run()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the CLI's contract: one line, non-zero exit; BaseException
        # because torch's DCP CheckpointException derives from it, not from Exception
        if verbose:
            raise
        print(f"autoplan {command}: error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
