"""Swap chosen Linears for torchao's float8 Linears, before any parallel style touches them.

Why before: the parallel styles (ours and torch's) shard whatever ``nn.Linear`` they are given and
``Float8Linear`` is one, so a converted model takes the same plan unchanged. The casts inside
``Float8Linear`` then run on DTensors: the amax of a sharded activation, weight or gradient is a
``max`` over a sharded DTensor -- a Partial(max) that DTensor all-reduces before the scale is
formed -- so every rank scales with the global amax, the number one device computes (what
torchao's float8 TP styles arrange for torch's styles by hand). Rowwise scales reduce the same way
along the sharded row. FSDP2 gathers a tensorwise weight in float8 when the conversion says so
(``fsdp_float8_all_gather``); :mod:`hyper_parallel.core.float8.fsdp` computes those weights'
scales over the whole mesh before each forward.

Which modules convert is the caller's decision (a plan states it per module); this module refuses
what cannot run -- a module that is not a plain Linear, dimensions the float8 GEMM cannot take --
with a typed error naming the module and the reason, before changing anything.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from hyper_parallel.core.float8.errors import Float8Error, Float8ShapeError
from hyper_parallel.core.float8.fsdp import float8_gathered
from hyper_parallel.core.float8.quiet import quiet_torchao_import
from hyper_parallel.core.float8.recipes import DIM_MULTIPLE, check_recipe, linear_config, resolve_emulate
from hyper_parallel.core.fqn_pattern import fqn_matches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Float8Conversion:
    """What :func:`convert_to_float8` did: the converted module names, the recipe per name, and
    whether the GEMMs are emulated."""

    modules: dict[str, str]
    emulate: bool
    fsdp_float8_all_gather: bool


def float8_shape_problem(in_features: int, out_features: int, recipe: str, shards: tuple[int, int] = (1, 1)) -> str:
    """Why a Linear of these features cannot run ``recipe`` when its in/out features are split
    ``shards`` ways (tensor parallel), or "" when it can: every GEMM dimension a rank sees must be a
    multiple of 16 (32 for MXFP8 blocks)."""
    multiple = DIM_MULTIPLE[check_recipe(recipe)]
    for name, size, ways in (("in_features", in_features, shards[0]), ("out_features", out_features, shards[1])):
        if size % ways or (size // ways) % multiple:
            local = f" ({size} / {ways} = {size / ways:g} per rank)" if ways > 1 else ""
            return f"{name} {size}{local} is not a multiple of {multiple}, which {recipe} float8 GEMMs need"
    return ""


def _targets(model: nn.Module, modules: dict[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """{fqn: (module, recipe)} of every module a pattern of ``modules`` names (the most specific
    pattern wins, as for styles); a pattern matching nothing is an error."""
    found: dict[str, tuple[nn.Module, str, int]] = {}
    for pattern, recipe in modules.items():
        check_recipe(recipe, where=f"float8 module {pattern!r}")
        hits = [(fqn, m) for fqn, m in model.named_modules() if fqn and fqn_matches(pattern, fqn)]
        if not hits:
            raise Float8Error(f"float8 module pattern {pattern!r} matches no module of {type(model).__name__}")
        specificity = sum(1 for atom in pattern.split(".") if not any(c in atom for c in "*?["))
        for fqn, m in hits:
            if fqn not in found or specificity > found[fqn][2]:
                found[fqn] = (m, recipe, specificity)
    return {fqn: (m, r) for fqn, (m, r, _) in found.items()}


def _check(fqn: str, module: nn.Module, recipe: str) -> None:
    if type(module) is not nn.Linear:
        raise Float8Error(f"float8 on {fqn}: a {type(module).__name__} is not a plain nn.Linear; float8 training "
                          f"converts nn.Linear only (keep this module in high precision)")
    problem = float8_shape_problem(module.in_features, module.out_features, recipe)
    if problem:
        raise Float8ShapeError(f"float8 on {fqn}: {problem}; keep it in high precision")


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _mxfp8_linear(module: nn.Linear) -> nn.Module:
    quiet_torchao_import()
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear   # torchao on first use

    with torch.device("meta"):
        new = MXFP8Linear(module.in_features, module.out_features, bias=False)
    new.weight, new.bias = module.weight, module.bias
    return new


def convert_to_float8(model: nn.Module, modules: dict[str, str], *, device: torch.device | str | None = None,
                      emulate: bool | None = None, fsdp_float8_all_gather: bool = False) -> Float8Conversion:
    """Replace each Linear named by a pattern of ``modules`` ({pattern: recipe}) with its float8
    version, in place; parameters are kept (same objects, same names: checkpoints and optimizers
    see the same state). ``emulate``: None emulates exactly where ``device`` (default: the model's)
    has no float8 GEMM. ``fsdp_float8_all_gather``: FSDP2 will gather the tensorwise weights in
    float8. Everything is checked before the first swap."""
    if not isinstance(modules, dict):
        raise Float8Error(f"convert_to_float8: modules must be a dict {{pattern: recipe}}, got {type(modules).__name__}")
    if not modules:
        return Float8Conversion({}, emulate=bool(emulate), fsdp_float8_all_gather=False)
    targets = _targets(model, modules)
    for fqn, (module, recipe) in targets.items():
        _check(fqn, module, recipe)
    if device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    recipes = {recipe for _, recipe in targets.values()}
    emulated = {recipe: resolve_emulate(recipe, device, emulate) for recipe in recipes}
    configs = {r: linear_config(r, emulate=emulated[r], fsdp_float8_all_gather=fsdp_float8_all_gather and r == "tensorwise")
               for r in recipes if r != "mxfp8"}
    quiet_torchao_import()
    from torchao.float8.float8_linear import Float8Linear   # torchao on first use

    for fqn, (module, recipe) in targets.items():
        new = _mxfp8_linear(module) if recipe == "mxfp8" else Float8Linear.from_float(module, config=configs[recipe])
        new.train(module.training)
        _swap(model, fqn, new)
    log.debug("float8: %d Linears converted (%s)", len(targets), ", ".join(sorted(recipes)))
    return Float8Conversion({fqn: r for fqn, (_, r) in targets.items()}, emulate=any(emulated.values()),
                            fsdp_float8_all_gather=fsdp_float8_all_gather and "tensorwise" in recipes)


def float8_linears(model: nn.Module) -> dict[str, str]:
    """{fqn: recipe} of the float8 Linears ``model`` holds now -- what runs, not what a plan asked
    for (a run's log says it, so a float8 run that silently trains in high precision shows)."""
    torchao_linear = sys.modules.get("torchao.float8.float8_linear")
    if torchao_linear is None:   # torchao never imported: nothing was converted
        return {}
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, torchao_linear.Float8Linear):
            granularity = m.config.cast_config_input.scaling_granularity.value
            out[fqn] = "rowwise" if granularity == "axiswise" else granularity
        elif type(m).__name__ == "MXFP8Linear":
            out[fqn] = "mxfp8"
    return out


def float8_summary(model: nn.Module) -> str:
    """One line on the float8 Linears ``model`` holds ("" when none): how many, which recipes,
    emulated or native, how many weights FSDP gathers in float8."""
    linears = float8_linears(model)
    if not linears:
        return ""
    emulated = sum(bool(getattr(getattr(model.get_submodule(f), "config", None), "emulate", False)) for f in linears)
    recipes = ", ".join(f"{r} {sum(v == r for v in linears.values())}" for r in sorted(set(linears.values())))
    how = "emulated" if emulated == len(linears) else ("native" if not emulated else f"{emulated} emulated")
    return (f"float8: {len(linears)} Linears on this rank ({recipes}; {how}), "
            f"{float8_gathered(model)} weights gathered in float8")
