"""Float8 numerics of a plan: several training steps of its float8 Linears, on local gloo ranks,
against the same model in float8 on one device.

A float8 plan cannot be judged against the high-precision model: the casts change every GEMM by
up to float8's rounding. What the plan must reproduce is one device running the *same* float8
recipe on the same Linears -- the same scales (from the global amax of each sharded tensor), the
same casts, the same products. So every rank builds the small copy three times: one device in
float8 (the plan's precision section, emulated), one device in the model's own dtype (to show
that float8 changed the numbers at all), and the plan applied; each takes ``steps`` SGD steps on
the same batches and the losses are compared step by step.

A fourth copy, one device in float8 with every weight one float32 ulp off, measures the noise
floor: float8 turns a last-bit difference into a whole float8 step of one element whenever the
element sits on a rounding boundary, and a sharded GEMM's summation order makes exactly such
differences. A plan farther from one device than that floor is wrong; one within it is not.

A fifth copy, one device in float8 that splits each batch as the plan does (its data-parallel
ranks' rows, then its micro-batches: gradient accumulation over the same row blocks), separates a
second effect: a float8 cast takes its scale from the tensor it casts, and a plan that splits the
batch casts each block's activations and gradients with that block's own amax -- rowwise scales
of the weight-gradient GEMM run along the tokens, so they are a block's, not the batch's. Every
float8 data-parallel run does this (torchao and torchtitan reduce the weights' amax over the mesh,
never the activations'); one device on the whole batch is a different float8 computation, and the
split copy is the same one. Under pure tensor parallelism the split copy is the one-device copy.

``optimizer``: ``"sgd"`` or ``"adamw"`` (torch's defaults but ``lr``). SGD at lr 0.1 moves weights
far more per step than training does (AdamW at 1e-4 to 3e-4 for pretraining and fine-tuning), and
every weight float8 moves further changes every later step's rounding.
"""
from __future__ import annotations

import math
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import InvalidArgumentError
from autoplan.parallelisms.precision import float8_modules
from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.plan.plan import Plan
from autoplan.verify.numerics import _vocab, small_plan
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.core.float8 import convert_to_float8, float8_gathered, float8_linears, quiet_torchao_import
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.local import RankPool, cached_mesh

RTOL_LOSS = 1e-4
LR = 0.1
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


@dataclass
class Float8StepsResult:
    """Per-step losses of the plan, of one device in float8, and of one device in high precision."""

    passed: bool
    par: list[float] = field(default_factory=list)
    float8: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    noise: list[float] = field(default_factory=list)   # one device in float8, every weight one ulp off
    split: list[float] = field(default_factory=list)   # one device in float8, the batch split as the plan's
    chunks: int = 1              # row blocks per batch: dp ranks x micro-batches
    linears: list[str] = field(default_factory=list)        # float8 Linears the plan's ranks hold (union)
    linears_one: list[str] = field(default_factory=list)    # float8 Linears of one device in float8
    float8_modules: int = 0
    gathered: int = 0            # weights FSDP gathers in float8 on rank 0
    error: str | None = None

    @property
    def max_rel_float8(self) -> float:
        return max((abs(p - r) / abs(r) for p, r in zip(self.par, self.float8)), default=math.nan)

    @property
    def max_rel_noise(self) -> float:
        """How far one device in float8 moves from itself when every weight moves one ulp: the floor
        below which a plan's difference is float8 rounding of last-bit noise, not a fault."""
        return max((abs(p - r) / abs(r) for p, r in zip(self.noise, self.float8)), default=math.nan)

    @property
    def first_rel_float8(self) -> float:
        """Step 1's relative loss difference: a forward before any update (accumulated rounding of
        earlier steps cannot cause it)."""
        return abs(self.par[0] - self.float8[0]) / abs(self.float8[0]) if self.par else math.nan

    @property
    def max_rel_split(self) -> float:
        """How far the plan is from one device in float8 that splits each batch as the plan does."""
        return max((abs(p - r) / abs(r) for p, r in zip(self.par, self.split)), default=math.nan)

    @property
    def max_rel_high(self) -> float:
        return max((abs(p - r) / abs(r) for p, r in zip(self.par, self.high)), default=math.nan)


def _one_ulp(model, seed: int) -> None:
    """Move every parameter by one float32 unit in the last place, up or down at random: a run that
    differs from one device exactly as much as a sharded GEMM's summation order makes it differ."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.mul_(1 + sign * torch.finfo(p.dtype).eps)


def _step(model, tokens, targets, opt, chunks: int = 1) -> float:
    """One optimizer step over ``chunks`` equal row blocks of the batch (gradient accumulation of
    the blocks' mean losses: the batch's mean loss and gradient, each block's own float8 scales)."""
    opt.zero_grad()
    total = 0.0
    for t, y in zip(tokens.chunk(chunks), targets.chunk(chunks)):
        loss = lm_loss(output_logits(forward_tokens(model, t)), y) / chunks
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


def float8_steps_rank(plan_json: str, recipe: ModelRecipe, global_batch: int, seq: int, steps: int = 5,
                      lr: float = 0.1, seed: int = 11, optimizer: str = "sgd") -> dict:
    """On every rank of the current process group: ``steps`` optimizer steps of the plan, of one
    device in the plan's float8 (on the whole batch, with one ulp of noise, and split as the plan
    splits it) and of one device in high precision; returns the loss lists."""
    plan = Plan.from_json(plan_json)
    plan = small_plan(plan, recipe.build("meta"))
    float8, high, par, noisy, split = (recipe.build() for _ in range(5))
    _one_ulp(noisy, seed)
    modules = {p: r for p, r in float8_modules(plan).items() if match_modules(float8, p)}
    if modules:
        plan = plan.replace(parallel=dict(plan.parallel, precision=dict(plan.parallel["precision"], modules=modules)))
    for model in (float8, noisy, split):
        convert_to_float8(model, modules, emulate=True)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    runner = plan.apply(par, mesh)
    make = OPTIMIZERS[optimizer]
    runner.optimizer = make(par.parameters(), lr=lr)
    opts = [make(m.parameters(), lr=lr) for m in (float8, high, noisy, split)]
    dp = runner.dp_mesh.size() if runner.dp_mesh is not None else 1
    chunks = dp * int(plan.pipeline["microbatches"] if plan.pipeline else runner.microbatches)
    vocab = _vocab(high)
    g = torch.Generator().manual_seed(seed)
    out = {"par": [], "float8": [], "high": [], "noise": [], "split": [], "modules": len(modules),
           "gathered": float8_gathered(par), "chunks": chunks,
           "linears": sorted(float8_linears(par)), "linears_one": sorted(float8_linears(float8))}
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (global_batch, seq), generator=g)
        targets = torch.randint(0, vocab, (global_batch, seq), generator=g)
        out["float8"].append(_step(float8, tokens, targets, opts[0]))
        out["high"].append(_step(high, tokens, targets, opts[1]))
        out["noise"].append(_step(noisy, tokens, targets, opts[2]))
        out["split"].append(_step(split, tokens, targets, opts[3], chunks))
        loss = torch.tensor(runner.step(runner.local_batch(tokens, targets)), dtype=torch.float64)
        if runner.dp_mesh is not None and runner.dp_mesh.size() > 1:
            dist.all_reduce(loss, group=runner.dp_mesh.get_group())
            loss /= runner.dp_mesh.size()
        out["par"].append(float(loss))
    return out


def check_float8_steps(plan: Plan, recipe: ModelRecipe, *, pool=None, global_batch: int | None = None,
                       seq: int = 16, steps: int = 5, lr: float = LR, optimizer: str = "sgd") -> Float8StepsResult:
    """Run :func:`float8_steps_rank` on ``pool`` (one of the plan's world size; started and closed
    when None). Passes when every step's loss equals one device in float8 (rtol 1e-4) on every rank."""
    if optimizer not in OPTIMIZERS:
        raise InvalidArgumentError(f"check_float8_steps: optimizer={optimizer!r} is not one; "
                                   f"valid: {sorted(OPTIMIZERS)}")
    world = math.prod(plan.mesh["shape"])
    dp = int(dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(plan.dp_dim, 1)) if plan.dp_dim else 1
    micro = int((plan.pipeline or {}).get("microbatches", 1))
    global_batch = global_batch or 2 * dp * micro
    own = pool is None
    try:
        if own:
            pool = RankPool(world)
        results = pool.run(float8_steps_rank, plan.to_json(), recipe, global_batch, seq, steps, lr, 11, optimizer)
    except Exception as exc:  # noqa: BLE001 - a failing plan is a result
        return Float8StepsResult(False, error="".join(traceback.format_exception_only(type(exc), exc))[-4000:])
    finally:
        if own and pool is not None:
            pool.close()
    r0 = results[0]
    ok = all(abs(p - f) <= RTOL_LOSS * abs(f) for r in results for p, f in zip(r["par"], r["float8"]))
    linears = sorted({name for r in results for name in r["linears"]})
    return Float8StepsResult(ok, r0["par"], r0["float8"], r0["high"], r0["noise"], r0["split"], r0["chunks"],
                             linears, r0["linears_one"], r0["modules"], r0["gathered"])



@contextmanager
def _recorded_casts(casts: list):
    """Every float8 cast torchao's Float8Linear makes inside the block (its inputs, weights and
    output gradients), appended to ``casts`` as (whole high-precision tensor, whole scale, float8
    dtype); a sharded tensor is gathered (a collective: every rank must make the same casts)."""
    quiet_torchao_import()
    import torchao.float8.float8_scaling_utils as scaling   # torchao on first use; patched for the block

    original = scaling.hp_tensor_and_scale_to_float8

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to(torch.float32).clone()

    def record(hp, scale, float8_dtype, *args, **kwargs):
        casts.append((whole(hp), whole(scale), float8_dtype))
        return original(hp, scale, float8_dtype, *args, **kwargs)

    scaling.hp_tensor_and_scale_to_float8 = record
    try:
        yield casts
    finally:
        scaling.hp_tensor_and_scale_to_float8 = original


def float8_casts_rank(plan_json: str, recipe: ModelRecipe, global_batch: int, seq: int, seed: int = 11) -> dict:
    """One forward and backward of a tensor-parallel plan and of one device in float8 on the same
    batch, every float8 cast compared in order: whether its scale equals one device's, in how many
    elements its high-precision operand and its float8 values differ. Why: a loss that differs
    from one device says nothing of where; this says whether a scale was taken over a shard (a
    fault) or last-bit differences crossed float8 rounding boundaries (the sum order). Tensor
    parallel only: the same casts run in the same order on both sides, on the whole batch."""
    from torchao.float8.float8_utils import to_fp8_saturated   # torchao on first use (convert imported it)

    plan = small_plan(Plan.from_json(plan_json), recipe.build("meta"))
    one, par = recipe.build(), recipe.build()
    modules = {p: r for p, r in float8_modules(plan).items() if match_modules(one, p)}
    convert_to_float8(one, modules, emulate=True)
    runner = plan.apply(par, cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])))
    vocab = _vocab(one)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (global_batch, seq), generator=g)
    targets = torch.randint(0, vocab, (global_batch, seq), generator=g)
    with _recorded_casts([]) as mine:
        loss_one = lm_loss(output_logits(forward_tokens(one, tokens)), targets)
        forward = len(mine)
        loss_one.backward()
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=0.0)
    with _recorded_casts([]) as theirs:
        loss_par = runner.step(runner.local_batch(tokens, targets))
    rows = []
    for (x1, s1, dtype), (x2, s2, _) in zip(mine, theirs):
        if x1.shape != x2.shape:
            rows.append({"shape": tuple(x1.shape), "comparable": False})
            continue
        f1, f2 = to_fp8_saturated(x1 * s1, dtype).float(), to_fp8_saturated(x2 * s2, dtype).float()
        rows.append({"shape": tuple(x1.shape), "comparable": True, "scale_equal": bool(torch.equal(s1, s2)),
                     "inputs_differ": int((x1 != x2).sum()), "float8_differ": int((f1 != f2).sum())})
    return {"casts": rows, "count": (len(mine), len(theirs)), "forward": forward,
            "loss": (float(loss_one.detach()), float(loss_par))}
