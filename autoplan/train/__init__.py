"""From a plan to a training run under torchrun, with checkpoints that resume under another plan.

    from autoplan.train import TrainConfig, train
    train(TrainConfig(model="titan-llama-debug", plan="plan.json", steps=20, checkpoint_dir="ckpt"))

``autoplan train`` is the same program on the command line; ``autoplan launch`` prints the
torchrun command a plan needs.
"""
from autoplan.train.config import TrainConfig
from autoplan.train.errors import (
    CheckpointConflictError, CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointUntrustedError,
    DataError, DivergenceError, TrainConfigError, TrainError,
)
from autoplan.train.launch import torchrun_command
from autoplan.train.loop import Trainer, TrainResult, train

__all__ = ["CheckpointConflictError", "CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError",
           "CheckpointUntrustedError", "DataError", "DivergenceError", "TrainConfig", "TrainConfigError", "TrainError",
           "TrainResult", "Trainer", "torchrun_command", "train"]
