"""A Mamba-2 mixer split on its heads over tp: the Mamba-2 half of MambaMixerParallel.

A Mamba-2 mixer (transformers' ``Mamba2Mixer``, Falcon-H1's ``FalconH1Mixer``) projects the stream
once, ``in_proj`` -> ``[z (I) | x (I) | B (G*N) | C (G*N) | dt (nh)]``, runs a depthwise
convolution over ``[x | B | C]``, a chunked scan per head (``nh`` heads of ``I / nh`` channels,
each reading the B/C of its group: ``nh / G`` heads per group), gates by ``z`` (optionally through
a norm per group) and projects back (``out_proj``). Megatron splits it on heads: each rank keeps
its heads' z/x/dt, its groups' B/C, and the matching conv channels, A_log, D, dt_bias and norm
rows; ``out_proj`` is row-parallel.

The packed parts of ``in_proj`` (and of the convolution) have different widths, so a rank's rows
are no one DTensor placement of the whole weight (a ``_StridedShard`` needs equal parts). They
stay whole, replicated parameters; each rank computes only its rows, selecting them by index
(``weight[rows]``), and the selection's gradient -- nonzero on the rank's rows only, and on a
group's B/C rows a partial sum over the heads that rank holds -- is all-reduced in backward
(Megatron's f applied to the weight: one all-reduce of in_proj's and conv1d's weight gradient per
step). When the groups do not divide tp but tp is a multiple of them (Falcon-H1: G = 1), each
rank's heads lie in one group and every rank holding heads of a group selects all its B/C rows; the
all-reduce sums their partial gradients. ``out_proj`` is ``Shard(1)`` and the per-head
parameters and the norm weight ``Shard(0)`` (their rows are contiguous per rank). The mixer's
input is copied into the split, ``out_proj``'s partial output all-reduced in forward; the module's
own forward runs on the local sizes (``intermediate_size``, ``num_heads``, ``n_groups``,
``conv_dim`` made local).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.nn.utils.stateless import _reparametrize_module

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP
from hyper_parallel.core.expert_parallel.layouts import local
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, check_divides
from hyper_parallel.core.tensor_parallel.sequence_region import region_in, region_out
from hyper_parallel.errors import DivisibilityError, UnsupportedModuleError

_SIZES = ("intermediate_size", "num_heads", "n_groups", "ssm_state_size", "head_dim", "conv_dim")
_PER_HEAD = ("A_log", "D", "dt_bias")


def is_mamba2(module: nn.Module) -> bool:
    """A Mamba-2 layout: one packed in_proj, no x_proj, heads and groups as attributes."""
    return not hasattr(module, "x_proj") and all(hasattr(module, a) for a in ("n_groups", "num_heads", "in_proj"))


def _sizes(module: nn.Module, where: str) -> dict[str, int]:
    sizes = {a: getattr(module, a, None) for a in _SIZES}
    bad = [a for a, v in sizes.items() if type(v) is not int or v < 1]
    if bad:
        raise UnsupportedModuleError(f"{where}: expected {', '.join(bad)} as positive ints (a Mamba-2 mixer)")
    return sizes


def check_mamba2(module: nn.Module, mesh: DeviceMesh, where: str) -> None:
    """Raise a typed error naming what does not fit; change nothing."""
    s = _sizes(module, where)
    inner, heads, groups, state = s["intermediate_size"], s["num_heads"], s["n_groups"], s["ssm_state_size"]
    for name in ("in_proj", "out_proj"):
        if not isinstance(getattr(module, name, None), nn.Linear):
            raise UnsupportedModuleError(f"{where}: expected {name} as an nn.Linear (a Mamba-2 mixer)")
    conv = getattr(module, "conv1d", None)
    packed = 2 * inner + 2 * groups * state + heads
    if module.in_proj.out_features != packed:
        raise UnsupportedModuleError(f"{where}: in_proj gives {module.in_proj.out_features} columns, not the "
                                     f"[z | x | B | C | dt] = {packed} a Mamba-2 mixer packs")
    if not isinstance(conv, nn.Conv1d) or conv.groups != s["conv_dim"] or s["conv_dim"] != inner + 2 * groups * state:
        raise UnsupportedModuleError(f"{where}: expected conv1d as a depthwise nn.Conv1d over [x | B | C]")
    if module.out_proj.bias is not None:
        raise UnsupportedModuleError(f"{where}: out_proj has a bias (a row-parallel sum would add it per rank)")
    if heads * s["head_dim"] != inner or heads % groups:
        raise UnsupportedModuleError(f"{where}: {heads} heads of {s['head_dim']} channels in {groups} groups do not "
                                     f"make the {inner} inner channels")
    for name in _PER_HEAD:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or tuple(p.shape) != (heads,):
            raise UnsupportedModuleError(f"{where}: expected {name} as a parameter of the {heads} heads")
    check_divides(heads, mesh, where, "the mixer's head count (num_heads)")
    t = mesh.size()
    norm_groups = getattr(getattr(module, "norm", None), "n_groups", None)
    if groups % t and (t % groups or norm_groups is not None):
        why = "its gated norm normalises over each group, which would span ranks" if norm_groups is not None \
            else "a rank's heads would read the B/C of several partial groups"
        raise DivisibilityError(f"{where}: the mixer's {groups} groups (n_groups) do not divide tp={t} ({why})")


def _rows(s: dict[str, int], t: int, r: int) -> tuple[list[int], list[int], list[int]]:
    """Rank r's rows of in_proj's [z|x|B|C|dt], of the conv's [x|B|C], and its heads."""
    inner, heads, groups, state = s["intermediate_size"], s["num_heads"], s["n_groups"], s["ssm_state_size"]
    chans = list(range(r * inner // t, (r + 1) * inner // t))
    mine = list(range(r * groups // t, (r + 1) * groups // t)) if groups % t == 0 else [r * groups // t]
    gn = [g * state + i for g in mine for i in range(state)]
    head_rows = list(range(r * heads // t, (r + 1) * heads // t))
    gs = groups * state
    conv = chans + [inner + i for i in gn] + [inner + gs + i for i in gn]
    proj = chans + [inner + c for c in conv] + [2 * inner + 2 * gs + h for h in head_rows]
    return proj, conv, head_rows


def mamba2_placements(params) -> dict:
    """The DTensor placements of a Mamba-2 mixer's memory-sharded parameters, by path (``params``:
    the paths it holds): out_proj by columns, the per-head vectors and the gated norm's weight by
    rows; in_proj and conv1d stay whole (see the module docstring)."""
    placements = {"out_proj.weight": Shard(1), **{n: Shard(0) for n in _PER_HEAD}}
    if "norm.weight" in params:
        placements["norm.weight"] = Shard(0)
    return {p: v for p, v in placements.items() if p in params}


def apply_mamba2(module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str,
                 sequence_dim: int | None = None) -> nn.Module:
    s, t, r = _sizes(module, fqn), mesh.size(), mesh.get_local_rank()
    proj, conv, _ = _rows(s, t, r)
    local_groups = max(s["n_groups"] // t, 1)
    norm = getattr(module, "norm", None)
    held = ["out_proj.weight", *_PER_HEAD] + (["norm.weight"] if isinstance(getattr(norm, "weight", None),
                                                                          nn.Parameter) else [])
    placements = mamba2_placements(held)
    sharded = list(placements)
    for path, placement in placements.items():
        owner, _, name = path.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        record.replace_param(sub, name, record.sharded(sub._parameters[name], (placement,), mesh, where=f"{fqn}.{path}"))
    for attr, value in (("intermediate_size", s["intermediate_size"] // t), ("num_heads", s["num_heads"] // t),
                        ("n_groups", local_groups), ("conv_dim", len(conv))):
        record.set_attr(module, attr, value)
    if hasattr(module, "groups_time_state_size"):
        record.set_attr(module, "groups_time_state_size", local_groups * s["ssm_state_size"])
    if norm is not None and isinstance(getattr(norm, "n_groups", None), int):
        record.set_attr(norm, "n_groups", local_groups)
    group = mesh.get_group()
    selected = {"in_proj.weight": proj, "in_proj.bias": proj, "conv1d.weight": conv, "conv1d.bias": conv}
    selected = {p: rows for p, rows in selected.items() if _get(module, p) is not None}
    inner = module.forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        x = region_in(hidden_states, group, sequence_dim)
        tensors = {p: local(_get(module, p)) for p in sharded}
        for path, rows in selected.items():   # whole weights, this rank's rows; their gradient all-reduced
            w = _get(module, path)
            tensors[path] = CopyToTP.apply(w, group)[torch.tensor(rows, device=w.device)]
        mup = getattr(module, "mup_vector", None)   # Falcon-H1's per-column multipliers: this rank's columns
        if isinstance(mup, torch.Tensor):
            tensors["mup_vector"] = mup[..., torch.tensor(proj, device=mup.device)]
        with _reparametrize_module(module, tensors):
            out = inner(x, *args, **kwargs)
        return region_out(out, group, sequence_dim)

    record.set_attr(module, "forward", forward)
    return module


def _get(module: nn.Module, path: str):
    owner, _, name = path.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return getattr(sub, name, None)
