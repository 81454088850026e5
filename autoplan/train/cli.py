"""``autoplan train``, ``autoplan export-hf`` and ``autoplan launch``: registered on the main CLI's subcommands.

    torchrun --standalone --nproc-per-node 4 -m autoplan.cli train --plan plan.json --steps 20
    autoplan launch plan.json --nnodes 64 --rdzv-endpoint node0:29500 -- --steps 1000

``train`` is :func:`autoplan.train.train` with a TrainConfig from the flags; ``launch`` prints the
torchrun line a plan needs (:func:`autoplan.train.launch.torchrun_command`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from autoplan.plan import Plan
from autoplan.train import checkpoint_key
from autoplan.train.config import TrainConfig
from autoplan.train.errors import TrainConfigError
from autoplan.train.export import export_checkpoint
from autoplan.train.launch import format_command, torchrun_command
from autoplan.train.loop import train


KEY_HELP = (f"a file holding the key that signs checkpoints (else ${checkpoint_key.ENV}, the key itself): saves "
            "sign their manifest with it (HMAC-SHA256), loads refuse checkpoints not signed with it")


def _pairs(text: str | None, flag: str) -> dict:
    """"dp=2,tp=2" -> {"dp": 2, "tp": 2}; values parsed as JSON where they can be (numbers, true)."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        key, eq, value = part.partition("=")
        if not key or not eq:
            raise TrainConfigError(f"train: {flag} {text!r}: expected KEY=VALUE[,KEY=VALUE...]")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def config_from_args(args) -> TrainConfig:
    model, layers = args.model, args.layers
    if args.plan and (model is None or layers is None):
        recorded = Plan.from_json(args.plan).model
        model = model or recorded.get("source")
        layers = layers or recorded.get("layers_override")
    betas = tuple(float(b) for b in args.betas.split(","))
    if len(betas) != 2:
        raise TrainConfigError(f"train: --betas {args.betas!r}: expected two numbers, e.g. 0.9,0.95")
    return TrainConfig(
        model=model or TrainConfig.model, layers=layers, model_args=_pairs(args.model_arg, "--model-arg"),
        seed=args.seed, plan=args.plan, constraints=_pairs(args.constraints, "--constraints"),
        hardware=args.hardware, shard_all=args.shard_all, data=args.data, data_format=args.data_format,
        tokenizer=args.tokenizer,
        token_dtype=args.token_dtype, batch=args.batch, seq=args.seq, steps=args.steps, lr=args.lr,
        min_lr=args.min_lr, warmup=args.warmup, schedule=args.schedule, weight_decay=args.weight_decay,
        betas=betas, mixed_precision=args.mixed_precision, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, metrics=args.metrics,
        log_every=args.log_every, progress=args.progress, overwrite=args.overwrite, max_loss=args.max_loss,
        clip_grad_norm=args.clip_grad_norm, init=args.init, export_hf=args.export_hf,
        precision=args.precision, compile=args.compile, compile_backend=args.compile_backend, compile_mode=args.compile_mode,
        async_tp=args.async_tp,
        checkpoint_key=args.checkpoint_key)


def _cmd_train(args) -> int:
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("autoplan.train").setLevel(logging.INFO)
    cfg = config_from_args(args)
    cfg.check()  # a meaningless setting fails before the process group, the plan or the model
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and result.rows:
        first, last = result.rows[0]["loss"], result.rows[-1]["loss"]
        print(f"trained steps {result.start_step}..{result.step}: loss {first:.5f} -> {last:.5f}")
    elif int(os.environ.get("RANK", "0")) == 0:
        print(f"nothing to train: the run is at step {result.step} already (--steps {cfg.steps})")
    return 0


def _cmd_export_hf(args) -> int:
    out = export_checkpoint(args.checkpoint, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None,
                            key=checkpoint_key.resolve(args.checkpoint_key))
    print(f"wrote {out}")
    return 0


def _launch_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--nnodes", type=int, default=None)
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: the plan's devices per node")
    p.add_argument("--rdzv-endpoint", default="$MASTER_ADDR:29500")
    p.add_argument("--job-id", default="autoplan")
    return p


def _cmd_launch(args) -> int:
    """Options may come before or after the plan; everything after ``--`` goes to ``autoplan train``."""
    rest = list(args.rest)
    cut = rest.index("--") if "--" in rest else len(rest)
    args = _launch_options(argparse.ArgumentParser(prog="autoplan launch")).parse_args(rest[:cut], namespace=args)
    plan = Plan.from_json(args.plan)
    argv = torchrun_command(plan, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                            rdzv_endpoint=args.rdzv_endpoint, job_id=args.job_id, train_args=rest[cut + 1:],
                            plan_path=args.plan)
    print(format_command(argv))
    nodes = argv[argv.index("--nnodes") + 1]
    if nodes != "1":
        print(f"# run the same line on each of the {nodes} nodes; --rdzv-endpoint is the first node's address")
    return 0


def register(sub) -> None:
    """Add ``train`` and ``launch`` to the main parser's subparsers."""
    t = sub.add_parser("train", help="train a model with a plan (run under torchrun; see `autoplan launch`)")
    t.add_argument("--plan", default=None, help="plan JSON (default: plan here with plan_cluster for this world)")
    t.add_argument("--constraints", default=None, help="when planning here: e.g. dp=2,tp=2 or pp=2,tp=2,fsdp=true")
    t.add_argument("--hardware", default=None, help="planning profile (default: cpu on CPU, h100_sxm otherwise)")
    t.add_argument("--shard-all", action="store_true", help="when planning here: shard every unit (tiny models)")
    t.add_argument("--model", default=None,
                   help="preset (autoplan.presets), hf:<model_type>, a local config.json or a save_pretrained "
                        "directory (its weights are loaded; default: the plan's, else titan-llama-debug)")
    t.add_argument("--layers", type=int, default=None)
    t.add_argument("--model-arg", default=None, help="config overrides, e.g. dim=256,n_heads=8")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default="synthetic",
                   help="synthetic, a token file (.npy/.bin/.pt), a text file, or image-text: a .jsonl of "
                        '{"image": path, "text": ...} lines or a folder of images with .txt beside them')
    t.add_argument("--data-format", default="auto", choices=("auto", "tokens", "image-text"),
                   help="auto: image-text for a folder or a .jsonl whose lines have an \"image\", else tokens")
    t.add_argument("--tokenizer", default="bytes",
                   help="for text: bytes, a tokenizer.json or a local HF directory; for image-text: a processor "
                        "directory (default: the --model directory)")
    t.add_argument("--token-dtype", default="uint16", help="element type of a .bin token file")
    t.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    t.add_argument("--seq", type=int, default=32)
    t.add_argument("--steps", type=int, default=20, help="train until this step")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--warmup", type=int, default=0)
    t.add_argument("--schedule", default="constant", choices=("constant", "cosine", "linear"))
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--betas", default="0.9,0.95")
    t.add_argument("--mixed-precision", default="auto", choices=("auto", "bf16", "fp32"))
    t.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp8-tensorwise", "fp8-rowwise"),
                   help="float8 Linears: the plan's choice (auto), none (bf16), or every Linear that can (fp8-*)")
    t.add_argument("--compile", default="auto", choices=("auto", "none", "blocks", "model"),
                   help="torch.compile the plan: each repeated block (blocks), each root whole (model) or not "
                        "(none); auto: blocks on accelerators, none on CPU")
    t.add_argument("--compile-backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    t.add_argument("--compile-mode", default=None, choices=(None, "default", "reduce-overhead", "max-autotune",
                                                            "max-autotune-no-cudagraphs"),
                   help="torch.compile mode")
    t.add_argument("--async-tp", action="store_true",
                   help="async tensor parallelism (inductor's micro-pipeline TP; needs --compile blocks|model, "
                        "inductor and CUDA with NCCL; refused by name elsewhere)")
    t.add_argument("--checkpoint-dir", default=None)
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    t.add_argument("--resume", default=None,
                   help="auto (default with --checkpoint-dir: the newest verified checkpoint there, else start "
                        "fresh), latest (it must exist), never, or a step-N directory")
    t.add_argument("--checkpoint-key", default=None, metavar="FILE", help=KEY_HELP)
    t.add_argument("--overwrite", action="store_true",
                   help="allow starting fresh (or from an older step) into a --checkpoint-dir holding newer "
                        "checkpoints: they are deleted")
    t.add_argument("--max-loss", type=float, default=None,
                   help="stop with DivergenceError when the loss exceeds this (a non-finite loss always stops)")
    t.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip the global gradient norm to this; the norm goes into the metrics as grad_norm")
    t.add_argument("--metrics", default=None, help="metrics file on rank 0: .csv, .jsonl or .json")
    t.add_argument("--log-every", type=int, default=1)
    t.add_argument("--progress", default="auto", choices=("auto", "rich", "log", "none"))
    t.add_argument("--init", default="auto", choices=("auto", "pretrained", "random"),
                   help="auto: load the weights of a --model directory that has them, else initialise from --seed")
    t.add_argument("--export-hf", default=None, help="after training, write the weights as a Hugging Face directory")
    t.set_defaults(func=_cmd_train)
    ex = sub.add_parser("export-hf", help="write a training checkpoint's model as a Hugging Face directory")
    ex.add_argument("checkpoint", help="a step-N directory written by autoplan train")
    ex.add_argument("--out", required=True, help="a new directory for config.json + model.safetensors")
    ex.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    ex.add_argument("--checkpoint-key", default=None, metavar="FILE", help=KEY_HELP)
    ex.set_defaults(func=_cmd_export_hf)
    la = _launch_options(sub.add_parser("launch", help="print the torchrun command line a plan needs"))
    la.add_argument("plan")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="launch options, then -- and flags for `autoplan train`")
    la.set_defaults(func=_cmd_launch)
