"""Argument checks shared by the public entry points (``autoplan``, ``plan_cluster``, the CLI).

Why one place: the same ``batch``, ``memory_limit`` or ``dtype`` reaches the planner through
several doors, and each door used to fail (or not) in its own way deep inside capture or the ILP
(a PuLP error for ``inf``, a RecursionError for ``"80GB"``, an untyped torch error for a zero
batch). Every check here runs before anything is captured or changed and raises
:class:`~autoplan.errors.InvalidArgumentError` naming the argument, the value and what is valid.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn as nn

from autoplan.errors import InvalidArgumentError, InvalidConstraintError, MissingInputsError
from autoplan.search.experts.search import stated_runtime
from autoplan.search.pricing.costing import RECOMPUTE
from cost_models.attention_kernels import KERNELS
from autoplan.search.pipeline.tower_placement import PLACEMENTS as TOWER_PLACEMENTS
from cost_models.fusion import COMPILE_MODES, UnknownCompileModeError, compile_mode
from cost_models.hardware import list_hardware, load_hardware
from cost_models.precision import float8_peak
from cost_models.overlap import DP_MODES
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES

UNBOUNDED = 1e30  # "no memory limit": large enough for any model, still a finite ILP coefficient

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def positive_int(value: Any, name: str, who: str, exc: type[Exception] = InvalidArgumentError) -> int:
    """``value`` as an int >= 1 (bools and floats refused: 2.5 sequences mean nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise exc(f"{who}: {name}={value!r} must be a positive integer")
    if value < 1:
        raise exc(f"{who}: {name}={value!r} must be >= 1")
    return int(value)


def optional_bool(value: Any, name: str, who: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"{who}: {name}={value!r} must be True, False or None")
    return value


def check_model(model: Any, who: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_batch(batch: Any, who: str, *, required: bool = True) -> tuple[int, int] | None:
    """``(global_batch, seq_len)`` as two positive ints (None when not required and not given)."""
    if batch is None and not required:
        return None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InvalidArgumentError(f"{who}: batch={batch!r} must be (global_batch, seq_len), "
                                   "e.g. batch=(512, 8192)")
    return positive_int(batch[0], "batch[0] (global batch)", who), positive_int(batch[1], "batch[1] (seq_len)", who)


def check_memory_limit(value: Any, who: str) -> float | None:
    """Bytes per rank as a positive number; ``float('inf')`` means no limit; None: the hardware's."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{who}: memory_limit={value!r} must be bytes per rank as a number "
                                   "(e.g. 80 * 2**30), float('inf') for no limit, or None for the hardware's")
    if math.isnan(value) or value <= 0:
        raise InvalidArgumentError(f"{who}: memory_limit={value!r} must be a positive number of bytes")
    return UNBOUNDED if math.isinf(value) else float(value)


def check_dtype(value: Any, who: str) -> torch.dtype | None:
    """A floating torch dtype; a name such as "bf16" or "float32" is read as that dtype."""
    if value is None:
        return None
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise InvalidArgumentError(f"{who}: dtype={value!r} is not a training dtype; "
                                       f"use torch.bfloat16, torch.float16, torch.float32 or one of {sorted(_DTYPE_NAMES)}")
        return _DTYPE_NAMES[key]
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgumentError(f"{who}: dtype={value!r} must be a floating-point torch.dtype "
                                   "(torch.bfloat16, torch.float16 or torch.float32)")
    return value


def check_hardware(value: Any, who: str) -> str | None:
    """A hardware profile name that exists (None: the caller's default)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(f"{who}: hardware={value!r} must be a profile name, one of {list_hardware()}")
    key = value.strip().lower().replace("-", "_").replace(" ", "_")
    if key != "cpu" and key not in list_hardware():
        raise InvalidArgumentError(f"{who}: hardware={value!r} is not a known profile; known: {list_hardware()}")
    return value


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's position table holds (HF ``max_position_embeddings`` /
    ``n_positions``, the repo Llama's ``max_seq_len``), or None when it does not say."""
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings", "max_seq_len"):
        v = getattr(config, key, None) if config is not None else None
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(model, "max_seq_len", None)
    return v if isinstance(v, int) and v > 0 else None


def check_batch_fits_model(model: nn.Module, seq: int, who: str) -> None:
    """A batch spec becomes token ids of length ``seq``: the model must take token ids and hold
    that many positions (a learned position table indexed past its end fails only at run time)."""
    if not takes_token_ids(model):
        raise MissingInputsError(
            f"{who}: batch= builds token ids, but {type(model).__name__} has no embedding table (not a language "
            "model?); pass example inputs= of one rank instead, e.g. inputs=(torch.empty(8, 3, 224, 224),)")
    limit = max_positions(model)
    if limit is not None and seq > limit:
        raise InvalidArgumentError(
            f"{who}: batch seq_len={seq} is longer than the {limit} positions {type(model).__name__}'s config allows "
            f"(max_position_embeddings / n_positions / max_seq_len); use seq_len <= {limit}, or raise that config "
            "value if the model's position encoding supports longer sequences")


def takes_token_ids(model: nn.Module) -> bool:
    """Whether a batch spec (token ids) can feed this model: it has an embedding table, or is a
    vision model whose inputs capture builds from the batch as images."""
    if getattr(model, "main_input_name", None) == "pixel_values":
        return True
    return any(isinstance(m, nn.Embedding) for m in model.modules())


def strict_bool(value: Any, name: str, who: str, exc: type[Exception] = InvalidArgumentError) -> bool:
    if not isinstance(value, bool):
        raise exc(f"{who}: {name}={value!r} must be True or False")
    return value


def check_compile(value: Any, who: str) -> str:
    """The compile mode ``compile=`` names (cost_models.fusion.compile_mode): a bool or one of
    ``COMPILE_MODES``; what the plan is priced as running compiled."""
    try:
        return compile_mode(value, who)
    except UnknownCompileModeError:
        raise InvalidArgumentError(f"{who}: compile={value!r} must be True, False or one of "
                                   f"{list(COMPILE_MODES)}") from None


OVERLAPS = ("none", "async_tp")


def check_overlap(value: Any, who: str) -> str:
    """What the plan is priced as overlapping beyond each runtime's own default: "none", or
    "async_tp" (sequence-parallel collectives fused with their matmuls; the plan then needs a
    compiled, inductor, CUDA run: ``hyper_parallel.core.async_tp``)."""
    if value is None:
        return "none"
    if value not in OVERLAPS:
        raise InvalidArgumentError(f"{who}: overlap={value!r} must be one of {list(OVERLAPS)}")
    return value


# a planning request's precision: "bf16" the model's own dtype everywhere (the default: float8
# changes a run's numerics, so it is asked for, as torchtitan's float8 converter and Megatron's
# --fp8-format are); "auto" float8 for each Linear where the plan's hardware makes it pay;
# "fp8-<recipe>" every Linear that can take that recipe
PRECISIONS = ("auto", "bf16", "fp8-tensorwise", "fp8-rowwise")
FLOAT8_PRICING = {"bf16": "", "auto": "auto", "fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}


def check_precision(value: Any, who: str, name: str = "precision", error: type = InvalidArgumentError) -> str:
    """One of ``PRECISIONS`` (None: "bf16")."""
    if value is None:
        return "bf16"
    if not isinstance(value, str) or value not in PRECISIONS:
        raise error(f"{who}: {name}={value!r} is not a precision; valid: {list(PRECISIONS)}")
    return value


def check_precision_on(precision: str, hardware: str | None, who: str) -> str:
    """A float8 recipe asked by name needs a float8 GEMM on the plan's hardware: a plan that says
    float8 where none runs would be priced as one thing and run as another (``autoplan train``
    emulates float8 on a CPU to check numerics, never to plan for it). "auto" there keeps bf16."""
    if precision.startswith("fp8-") and hardware is not None:
        profile = load_hardware(hardware)
        if float8_peak(profile, precision.removeprefix("fp8-")) is None:
            raise InvalidArgumentError(f"{who}: precision={precision!r} on {hardware}, which has no float8 GEMM "
                                       f"(no peak_flops.fp8 in its profile); valid there: 'bf16' or 'auto'")
    return precision


def check_styles(styles: Any, who: str) -> dict | None:
    """A hand-written plan to price: a non-empty {pattern: ParallelStyle or style dict}."""
    if styles is not None and (not isinstance(styles, dict) or not styles):
        raise InvalidArgumentError(f"{who}: styles={styles!r} must be a non-empty dict {{pattern: ParallelStyle or "
                                   "style dict}}")
    return styles


# ------------------------------------------------------------------ plan_cluster's own arguments
CONSTRAINT_KEYS = ("dp", "pp", "tp", "cp", "ep", "schedule", "microbatches", "microbatch_size", "fsdp",
                   "activation_checkpointing", "virtual_stages", "dp_mode", "recompute", "expert_parallel",
                   "tower_placement", "cuts", "expert_runtime", "attention_kernel", "loss_bytes_per_logit",
                   "precision", "reshard_after_forward", "prefetch")
PIPELINE_CUTS = ("even", "balanced")   # blocks spread evenly (Megatron-Core, AutoModel) | the planner's by cost


def check_sequence(value: Any, name: str, who: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise InvalidArgumentError(f"{who}: {name}={value!r} must be a non-empty list")
    return list(value)


def check_choices(value: Any, name: str, valid: tuple[str, ...] | list[str], who: str) -> list[str]:
    """A non-empty list drawn from ``valid`` (e.g. schedule names)."""
    items = check_sequence(value, name, who)
    bad = [v for v in items if v not in valid]
    if bad:
        raise InvalidArgumentError(f"{who}: {name} {bad} not known; valid: {list(valid)}")
    return items


def check_constraints(constraints: Any, devices: int, batch: tuple[int, int], who: str, *,
                      fsdp: bool | None = None, activation_checkpointing: bool | None = None) -> dict:
    """plan_cluster's ``constraints`` checked against the device count and the batch, with the
    ``fsdp`` / ``activation_checkpointing`` keywords folded in (a contradiction is an error)."""
    if constraints is None:
        constraints = {}
    if not isinstance(constraints, dict):
        raise InvalidConstraintError(f"{who}: constraints={constraints!r} must be a dict such as {{'pp': 2}}")
    cons = dict(constraints)
    unknown = sorted(set(cons) - set(CONSTRAINT_KEYS), key=str)
    if unknown:
        raise InvalidConstraintError(f"{who}: unknown constraints {unknown}; valid keys: {list(CONSTRAINT_KEYS)}")
    gb = batch[0]
    for key in ("dp", "pp", "tp", "cp", "ep"):
        if key in cons:
            v = positive_int(cons[key], f"constraints[{key!r}]", who, InvalidConstraintError)
            if devices % v:
                raise InvalidConstraintError(f"{who}: constraints[{key!r}]={v} does not divide devices={devices}; "
                                           f"valid: one of {[d for d in range(1, devices + 1) if devices % d == 0]}")
    fixed = [cons[k] for k in ("dp", "pp", "tp", "cp", "ep") if k in cons]
    product = 1
    for v in fixed:
        product *= v
    whole = all(k in cons for k in ("dp", "pp", "tp"))
    if devices % product or (whole and product != devices):
        raise InvalidConstraintError(f"{who}: constraints dp x pp x tp (x cp x ep) = {product} cannot make "
                                     f"devices={devices} (with dp, pp and tp all fixed, give cp or ep too)")
    if "cp" in cons and batch[1] % (2 * cons["cp"]):
        raise InvalidConstraintError(f"{who}: constraints['cp']={cons['cp']}: the sequence {batch[1]} is not "
                                     f"divisible by 2*cp = {2 * cons['cp']} (context parallel cuts it into 2*cp chunks)")
    if "cp" in cons and "ep" in cons and cons["cp"] > 1 and cons["ep"] > 1:
        raise InvalidConstraintError(f"{who}: constraints cp={cons['cp']} and ep={cons['ep']}: a plan has one of "
                                     "context or expert parallelism, not both (not yet)")
    if "dp" in cons and gb % cons["dp"]:
        raise InvalidConstraintError(f"{who}: global batch {gb} is not divisible by constraints['dp']={cons['dp']}")
    if "schedule" in cons and cons["schedule"] not in SCHEDULE_NAMES:
        raise InvalidConstraintError(f"{who}: constraints['schedule']={cons['schedule']!r} is not a schedule; "
                                   f"valid: {list(SCHEDULE_NAMES)}")
    for key in ("microbatches", "microbatch_size"):
        if key in cons:
            v = positive_int(cons[key], f"constraints[{key!r}]", who, InvalidConstraintError)
            if gb % v:
                raise InvalidConstraintError(f"{who}: constraints[{key!r}]={v} does not divide the global batch {gb}; "
                                           f"valid: a divisor of {gb}")
    if "microbatches" in cons and "microbatch_size" in cons and gb % (cons["microbatches"] * cons["microbatch_size"]):
        raise InvalidConstraintError(f"{who}: microbatches x microbatch_size = "
                                   f"{cons['microbatches'] * cons['microbatch_size']} does not divide the global batch {gb}")
    if "virtual_stages" in cons:
        positive_int(cons["virtual_stages"], "constraints['virtual_stages']", who, InvalidConstraintError)
    for key, valid in (("dp_mode", DP_MODES), ("recompute", RECOMPUTE)):
        if key in cons and cons[key] not in valid:
            raise InvalidConstraintError(f"{who}: constraints[{key!r}]={cons[key]!r}; valid: {list(valid)}")
    if "cuts" in cons and cons["cuts"] not in PIPELINE_CUTS:
        raise InvalidConstraintError(f"{who}: constraints['cuts']={cons['cuts']!r}; valid: {list(PIPELINE_CUTS)}")
    if "tower_placement" in cons and cons["tower_placement"] not in TOWER_PLACEMENTS:
        raise InvalidConstraintError(f"{who}: constraints['tower_placement']={cons['tower_placement']!r}; valid: "
                                     f"{list(TOWER_PLACEMENTS)}")
    check_runtime_facts(cons, who)
    if "precision" in cons:
        check_precision(cons["precision"], who, "constraints['precision']", InvalidConstraintError)
    _check_fsdp_options(cons, who)
    if "expert_parallel" in cons:   # True: ExpertParallel only, False: replicated experts (ep as dp)
        strict_bool(cons["expert_parallel"], "constraints['expert_parallel']", who, InvalidConstraintError)
    for key, given in (("fsdp", fsdp), ("activation_checkpointing", activation_checkpointing)):
        if key in cons:
            strict_bool(cons[key], f"constraints[{key!r}]", who, InvalidConstraintError)
        if given is not None:
            if key in cons and cons[key] != given:
                raise InvalidConstraintError(f"{who}: {key}={given} contradicts constraints[{key!r}]={cons[key]}")
            cons[key] = given
    return cons


def _check_fsdp_options(cons: dict, who: str) -> None:
    """FSDP2's overlap options (``reshard_after_forward``: bool, ``prefetch``: blocks gathered
    ahead) make sense for FSDP only: they fix ``dp_mode`` to "fsdp", and contradict any other."""
    given = [k for k in ("reshard_after_forward", "prefetch") if k in cons]
    if not given:
        return
    if "reshard_after_forward" in cons:
        strict_bool(cons["reshard_after_forward"], "constraints['reshard_after_forward']", who, InvalidConstraintError)
    if "prefetch" in cons and (isinstance(cons["prefetch"], bool) or not isinstance(cons["prefetch"], int)
                               or cons["prefetch"] < 0):
        raise InvalidConstraintError(f"{who}: constraints['prefetch']={cons['prefetch']!r}; valid: an int >= 0 "
                                     "(blocks FSDP gathers ahead; 0: FSDP2's own order)")
    if cons.get("dp_mode", "fsdp") != "fsdp" or cons.get("fsdp") is False:
        raise InvalidConstraintError(f"{who}: constraints[{given[0]!r}] is an FSDP option, but the constraints ask "
                                     f"for dp_mode={cons.get('dp_mode', 'replicate')!r}; valid: with FSDP")
    cons["dp_mode"] = "fsdp"


def check_runtime_facts(cons: dict, who: str) -> None:
    """The constraints that state facts of the runtime a plan is priced for, where it is not
    hyper_parallel's (a published run's framework): ``expert_runtime`` (how it moves and keeps the
    experts' tokens: an ``ExpertRuntime`` or one of ``EXPERT_RUNTIMES``), ``attention_kernel`` (its
    fused attention, ``cost_models.attention_kernels``) and ``loss_bytes_per_logit`` (its loss's HBM
    bytes per logit)."""
    if "expert_runtime" in cons:
        try:
            stated_runtime(cons["expert_runtime"])
        except ValueError as e:
            raise InvalidConstraintError(f"{who}: constraints['expert_runtime']: {e}") from None
    if "attention_kernel" in cons and cons["attention_kernel"] not in KERNELS:
        raise InvalidConstraintError(f"{who}: constraints['attention_kernel']={cons['attention_kernel']!r}; valid: "
                                     f"{sorted(KERNELS)}")
    value = cons.get("loss_bytes_per_logit", 1.0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise InvalidConstraintError(f"{who}: constraints['loss_bytes_per_logit']={value!r} must be a positive "
                                     "number of bytes")


def check_pipeline_depth(constraints: dict, n_units: int, who: str) -> None:
    """A fixed pp needs at least one pipeline unit (embedding, block, norm, head) per stage."""
    pp = constraints.get("pp")
    if pp is not None and pp > n_units:
        raise InvalidConstraintError(f"{who}: constraints['pp']={pp} exceeds the model's {n_units} pipeline units "
                                   f"(embedding, blocks, norm, head); valid: pp <= {n_units}")
