"""TrainConfig: every setting of a training run, as data (what the CLI parses and the API takes).

One dataclass so ``autoplan train`` and ``autoplan.train.train(TrainConfig(...))`` are the same
program, and a checkpoint can record the settings it was written with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    data: str = "synthetic"          # "synthetic", a token-id file (.npy/.bin/.pt) or a text file (.txt)
    tokenizer: str = "bytes"         # for text: "bytes" or a local tokenizer.json / HF tokenizer directory
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
    # checkpoints and output
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0        # 0: only at the end when checkpoint_dir is set
    resume: str | None = None        # "latest" (in checkpoint_dir) or a step directory
    metrics: str | None = None       # .csv, .json or .jsonl on rank 0
    log_every: int = 1
    progress: str = "auto"           # auto (rich on a TTY, log lines otherwise) | rich | log | none
    # weights: "auto" loads the safetensors of a --model directory that has them and initialises
    # otherwise; "pretrained" requires them; "random" initialises from seed even when they exist
    init: str = "auto"
    export_hf: str | None = None     # after training: write the weights as a Hugging Face directory

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d
