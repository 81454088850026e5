"""The divergence guard and gradient-norm clipping: a run that blows up stops instead of saving.

A loss that turns NaN/inf (or passes ``--max-loss``) never comes back, and every checkpoint saved
after it is poison that ``--resume auto`` would pick up. So the loop checks each step's loss
*before* that step can be saved and raises DivergenceError naming the step: the last checkpoint
stays the last good one. The loss every rank sees is the same global value, but the verdict is
still agreed with one all-reduce (MAX of a flag), so a rounding difference near ``--max-loss``
cannot leave one rank saving while another stops.

Clipping (``--clip-grad-norm``) runs as an optimizer step pre-hook, i.e. after the runner's
backward and its data-parallel gradient reduction and right before AdamW steps -- the runner
itself is not touched. The global norm over DTensor gradients (FSDP shards, TP shards, both) is
each gradient's norm as a full tensor (DTensor reduces over its own mesh), squared and summed;
a pipeline rank holds only its stages' gradients, so the sums are all-reduced over the pipeline
group. The norm before clipping is reported in the metrics as ``grad_norm``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.parallelisms.data import unique_params
from autoplan.train.errors import DivergenceError, TrainConfigError


def check_loss(loss: float, step: int, max_loss: float | None, device: torch.device) -> None:
    """Raise DivergenceError on every rank when ``loss`` at ``step`` is non-finite or over ``max_loss``."""
    bad = not math.isfinite(loss) or (max_loss is not None and loss > max_loss)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor(float(bad), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(flag.item())
    if bad:
        what = "not finite" if not math.isfinite(loss) else f"above --max-loss {max_loss}"
        raise DivergenceError(
            f"train: the loss diverged at step {step} (loss {loss!r}, {what}); stopped before saving it, so the "
            "last checkpoint is the last good one -- lower --lr, add --warmup or --clip-grad-norm, and resume "
            "from that checkpoint", step, loss)


def _params(runner) -> list[torch.nn.Parameter]:
    stages = getattr(runner, "stages", None)
    modules = [st.module for st in stages] if stages is not None else [runner.model]
    return [p for p in unique_params(*modules) if p.grad is not None]


def global_grad_norm(runner) -> torch.Tensor:
    """The L2 norm of every gradient of the whole model (collective over the model's meshes)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in _params(runner):
        n = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        total += n.detach().to(torch.float64).cpu() ** 2
    group = getattr(runner, "pp_group", None)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


class GradClipper:
    """``--clip-grad-norm``: scales every gradient so the global norm is at most ``max_norm``;
    ``last_norm`` is the norm before clipping of the latest step. ``remove()`` unhooks it."""

    def __init__(self, runner, max_norm: float):
        if getattr(runner, "zero1", None) is not None:
            raise TrainConfigError("train: --clip-grad-norm with a ZeRO-1 plan is not supported (its optimizer "
                                   "steps on reduce-scattered slices); leave it out or use an FSDP plan")
        self.runner, self.max_norm, self.last_norm = runner, float(max_norm), None
        self._handle = runner.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs) -> None:
        norm = global_grad_norm(self.runner)
        self.last_norm = float(norm)
        coef = self.max_norm / (self.last_norm + 1e-6)
        if coef < 1.0:
            for p in _params(self.runner):
                p.grad.mul_(coef)

    def remove(self) -> None:
        self._handle.remove()
