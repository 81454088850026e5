"""TrainConfig: every setting of a training run, as data (what the CLI parses and the API takes).

One dataclass so ``autoplan train`` and ``autoplan.train.train(TrainConfig(...))`` are the same
program, and a checkpoint can record the settings it was written with.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from autoplan.train.errors import TrainConfigError
from autoplan.precision.request import PRECISIONS

# what --data holds: auto (image-text for a folder or a .jsonl of {"image", "text"} lines), tokens, image-text
DATA_FORMATS = ("auto", "tokens", "image-text")


@dataclass
class TrainConfig:
    # model: a preset name, "hf:<model_type>" (transformers AutoConfig.for_model) or a local config.json
    model: str = "titan-llama-debug"
    layers: int | None = None
    model_args: dict[str, Any] = field(default_factory=dict)   # config overrides, e.g. {"dim": 256}
    seed: int = 0                                              # model init and synthetic data
    # plan: a plan file, or planned here with plan_cluster for the world size under these constraints
    plan: str | None = None
    constraints: dict[str, Any] = field(default_factory=dict)  # e.g. {"dp": 2, "tp": 2}
    hardware: str | None = None                                # planning profile (default: cpu or h100_sxm)
    shard_all: bool = False          # plan TP for every unit even where replication is cheaper (tiny models)
    # data
    data: str = "synthetic"          # "synthetic", a token-id file (.npy/.bin/.pt), a text file (.txt) or image-text
    data_format: str = "auto"        # auto | tokens | image-text (a .jsonl of {"image", "text"} or a folder)
    tokenizer: str = "bytes"         # for text: "bytes" or a local tokenizer.json / HF tokenizer directory;
                                     # for image-text: a processor directory (default: the --model directory)
    token_dtype: str = "uint16"      # element type of a raw .bin token file
    batch: int = 8                   # global batch in sequences
    seq: int = 32                    # tokens per sequence
    # optimizer and schedule
    steps: int = 20
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    schedule: str = "constant"       # constant | cosine | linear (decay after warmup)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    mixed_precision: str = "auto"    # auto (bf16 on accelerators, fp32 on cpu) | bf16 | fp32
    # float8 (docs/float8.md): auto (the plan's choice) | bf16 | fp8-tensorwise | fp8-rowwise
    precision: str = "auto"
    # torch.compile of the plan (docs/compile.md): auto (blocks on accelerators, none on cpu) | none | blocks | model
    compile: str = "auto"
    compile_backend: str = "inductor"
    compile_mode: str | None = None  # torch.compile's mode (default, reduce-overhead, max-autotune, ...)
    async_tp: bool = False           # inductor's micro-pipeline TP on the plan's TP group (docs/overlap.md)
    # checkpoints and output
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0        # 0: only at the end when checkpoint_dir is set
    resume: str | None = None        # auto (default with checkpoint_dir) | latest | never | a step directory
    # a file holding the key that signs checkpoints (else $AUTOPLAN_CHECKPOINT_KEY; see checkpoint_key.py):
    # with one, only checkpoints signed with it load. The path is recorded, never the key.
    checkpoint_key: str | None = None
    metrics: str | None = None       # .csv, .json or .jsonl on rank 0
    log_every: int = 1
    progress: str = "auto"           # auto (rich on a TTY, log lines otherwise) | rich | log | none
    # weights: "auto" loads the safetensors of a --model directory that has them and initialises
    # otherwise; "pretrained" requires them; "random" initialises from seed even when they exist
    init: str = "auto"
    export_hf: str | None = None     # after training: write the weights as a Hugging Face directory

    # faults (restart.py, guard.py)
    overwrite: bool = False          # allow deleting checkpoints beyond the start step (fresh start into a used dir)
    max_loss: float | None = None    # stop (DivergenceError) when the loss exceeds this; non-finite always stops
    clip_grad_norm: float | None = None  # clip the global gradient norm to this; reported as grad_norm

    def check(self) -> None:
        """Reject settings that cannot mean anything (TrainConfigError naming the flag, the value and
        what is valid) -- before a process group, a model or a checkpoint is touched."""
        def bad(flag: str, value, valid: str):
            raise TrainConfigError(f"train: {flag} {value!r}: {valid}")

        for flag, value, low in (("--steps", self.steps, 1), ("--batch", self.batch, 1), ("--seq", self.seq, 1),
                                 ("--log-every", self.log_every, 1), ("--warmup", self.warmup, 0),
                                 ("--checkpoint-every", self.checkpoint_every, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                bad(flag, value, f"must be an integer >= {low}" + (" (nothing would be trained)"
                                                                   if flag == "--steps" else ""))
        if self.layers is not None and (not isinstance(self.layers, int) or self.layers < 1):
            bad("--layers", self.layers, "must be an integer >= 1")
        for flag, value in (("--lr", self.lr), ("--min-lr", self.min_lr), ("--weight-decay", self.weight_decay)):
            if not math.isfinite(value) or value < 0 or (flag == "--lr" and value == 0):
                bad(flag, value, "must be a finite number " + ("> 0" if flag == "--lr" else ">= 0"))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("--betas", ",".join(map(str, self.betas)), "expected two numbers in [0, 1), e.g. 0.9,0.95")
        for flag, value in (("--max-loss", self.max_loss), ("--clip-grad-norm", self.clip_grad_norm)):
            if value is not None and not (math.isfinite(value) and value > 0):
                bad(flag, value, "must be a finite number > 0 (leave it out to disable)")
        if self.compile not in ("auto", "none", "blocks", "model"):
            bad("--compile", self.compile, "valid: auto, none, blocks, model")
        if self.data_format not in DATA_FORMATS:
            bad("--data-format", self.data_format, f"valid: {', '.join(DATA_FORMATS)}")
        if self.precision not in PRECISIONS:
            bad("--precision", self.precision, f"valid: {', '.join(PRECISIONS)}")
        if self.checkpoint_every and not self.checkpoint_dir:
            bad("--checkpoint-every", self.checkpoint_every, "saves nothing without --checkpoint-dir")
        if self.resume in ("auto", "latest") and not self.checkpoint_dir:
            bad("--resume", self.resume, "needs --checkpoint-dir (or give a step-N directory)")
        if self.overwrite and not self.checkpoint_dir:
            bad("--overwrite", True, "only means something with --checkpoint-dir")
        if self.checkpoint_key and not (self.checkpoint_dir or self.resume):
            bad("--checkpoint-key", self.checkpoint_key, "only means something with --checkpoint-dir or --resume")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d
