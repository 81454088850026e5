"""The module tree and its repeated blocks, found from structure before anything is traced.

Siblings in a container (ModuleList, ModuleDict, Sequential) are the same block when their
submodule types, parameter and buffer shapes and scalar settings agree; a setting equal to the
child's own index (``layer_idx``) does not count. A container groups its children when some of
them repeat, or when all are of one class (a stack of layers that all differ, e.g. two layers of
Gemma-2 alternating sliding and global attention, gives groups of one). Only the outermost such
containers form block groups; repeats nested inside a block (MoE experts) stay part of it.
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Iterator

import torch.nn as nn

from autoplan.capture.ir import BlockGroup, ModuleInfo
from autoplan.capture.key_span import key_span
from hyper_parallel.core.short_stack import short_stacks
from hyper_parallel.core.tensor_parallel.linear_styles import CONV1D, is_conv1d

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_SCALARS = (int, float, bool, str)


def type_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


# torch.nn layers whose parameters our styles know how to shard, matched by isinstance (Conv1D,
# not a torch.nn layer, by hyper_parallel's is_conv1d)
SHARDABLE_BASES = (nn.Linear, nn.Embedding)


def nn_base(module: nn.Module) -> str:
    """Type name of the shardable layer ``module`` is an instance of (a torch.nn base, or
    transformers' Conv1D: a linear layer with a transposed weight), else ""."""
    if is_conv1d(module):
        return CONV1D
    for base in SHARDABLE_BASES:
        if isinstance(module, base):
            return f"{base.__module__}.{base.__qualname__}"
    return ""


# rank: MLA's latent widths; group: query heads per KV head (repeat_kv by num_key_value_groups)
_SIZE_WORD = re.compile("head|size|dim|width|embd|embed|rank|group", re.IGNORECASE)


def _size_ints(obj: object) -> dict[str, int]:
    return {name: value for name, value in vars(obj).items()
            if type(value) is int and not name.startswith("_") and _SIZE_WORD.search(name)}


def size_attributes(module: nn.Module, config_cache: dict[int, dict[str, int]] | None = None) -> dict[str, int]:
    """The integer attributes of ``module`` and of the object it holds as ``config`` whose names
    say they are head counts or widths. Attention code that cuts its projections by them must see
    local values when its heads are sharded (hyper_parallel's PrepareHeadsInput).
    ``config_cache``: results per config object, for a caller walking many modules that share one
    (every HF layer holds the model's config)."""
    out = _size_ints(module)
    config = getattr(module, "config", None)
    if config is not None and not isinstance(config, nn.Module) and hasattr(config, "__dict__"):
        cache = {} if config_cache is None else config_cache
        if id(config) not in cache:
            cache[id(config)] = {f"config.{k}": v for k, v in _size_ints(config).items()}
        out.update(cache[id(config)])
    return out


def module_tree(model: nn.Module) -> tuple[dict[str, ModuleInfo], list[list[str]], int]:
    """(FQN -> ModuleInfo, tied parameter groups, distinct parameter count)."""
    infos: dict[str, ModuleInfo] = {}
    configs: dict[int, dict[str, int]] = {}
    for fqn, mod in model.named_modules(remove_duplicate=False):
        # the module's own table (named_parameters(recurse=False) walks the module tree machinery
        # per call: most of this function's time on a 3,000-module model)
        params = {n: tuple(p.shape) for n, p in mod._parameters.items() if p is not None}
        infos[fqn] = ModuleInfo(
            fqn=fqn,
            type=type_name(mod),
            params=params,
            num_params=sum(_numel(s) for s in params.values()),
            children=[f"{fqn}.{c}" if fqn else c for c, _ in mod.named_children()],
            nn_base=nn_base(mod),
            size_attrs=size_attributes(mod, configs),
            key_span=key_span(mod),
        )
    owners: dict[int, list[str]] = defaultdict(list)
    numels: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)].append(name)
        numels[id(p)] = p.numel()
    tied = [names for names in owners.values() if len(names) > 1]
    return infos, tied, sum(numels.values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _raw_signature(child: nn.Module) -> list[tuple[str, str, tuple, dict[str, object]]]:
    out = []
    for rel, mod in child.named_modules():
        scalars = {
            k: v
            for k, v in vars(mod).items()
            if not k.startswith("_") and k != "training" and isinstance(v, _SCALARS)
        }
        tensors = tuple(
            (n, tuple(t.shape), str(t.dtype))
            for table in (mod._parameters, mod._buffers) for n, t in table.items() if t is not None
        )
        out.append((rel, type_name(mod), tensors, scalars))
    return out


def _signatures(children: list[tuple[str, nn.Module]]) -> list[tuple]:
    """Structural signature per child; a setting equal to the child's own index in every child
    that has it (``layer_idx``) is left out."""
    raws = [_raw_signature(c) for _, c in children]
    keys = {(rel, k) for raw in raws for rel, _, _, sc in raw for k in sc}
    def equals_index(key: tuple[str, str], name: str, raw) -> bool:
        return any(
            rel == key[0] and str(sc.get(key[1])) == name and not isinstance(sc.get(key[1]), bool)
            for rel, _, _, sc in raw
        )

    def has(key: tuple[str, str], raw) -> bool:
        return any(rel == key[0] and key[1] in sc for rel, _, _, sc in raw)

    # a key counts when every child that has it holds its own index there (Mllama's cross-attention
    # layers have no ``self_attn.layer_idx``; the self-attention layers around them do)
    index_like = set()
    for key in keys:
        holders = [(name, raw) for (name, _), raw in zip(children, raws) if has(key, raw)]
        if len(holders) > 1 and all(equals_index(key, name, raw) for name, raw in holders):
            index_like.add(key)
    return [
        tuple(
            (rel, typ, tensors, tuple(sorted((k, v) for k, v in sc.items() if (rel, k) not in index_like)))
            for rel, typ, tensors, sc in raw
        )
        for raw in raws
    ]


def find_blocks(model: nn.Module) -> list[BlockGroup]:
    """Groups of identical siblings under the outermost containers, in model order."""
    groups: list[BlockGroup] = []
    inside: list[str] = []
    for fqn, mod in model.named_modules():
        if any(fqn == p or fqn.startswith(p + ".") for p in inside):
            continue
        if not isinstance(mod, _CONTAINERS):
            continue
        children = list(mod.named_children())
        if len(children) < 2 or not any(any(True for _ in c.parameters()) for _, c in children):
            continue
        by_sig: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for (name, child), sig in zip(children, _signatures(children)):
            by_sig.setdefault(sig, []).append((name, child))
        if len(by_sig) == len(children) and len({type(c) for _, c in children}) > 1:
            continue  # neither repeated nor a stack of one layer class: look deeper
        for k, members in enumerate(by_sig.values()):
            rep_name, rep = members[0]
            groups.append(
                BlockGroup(
                    id=f"{fqn}#{k}" if len(by_sig) > 1 else fqn,
                    prefix=fqn,
                    indices=[n for n, _ in members],
                    count=len(members),
                    representative=f"{fqn}.{rep_name}" if fqn else rep_name,
                    module_type=type_name(rep),
                    params_per_block=sum(p.numel() for p in rep.parameters()),
                )
            )
        inside.append(fqn)
    return groups


@contextlib.contextmanager
def only_representatives(model: nn.Module, groups: list[BlockGroup]) -> Iterator[dict[str, str]]:
    """Temporarily keep one member per block group in each container (restored on exit).

    Yields a map from the FQN a kept member has while shortened to its real FQN (a ModuleList
    renumbers from 0; a ModuleDict keeps its keys).
    """
    by_prefix: dict[str, list[BlockGroup]] = defaultdict(list)
    for g in groups:
        by_prefix[g.prefix].append(g)
    shorts: dict[str, nn.Module] = {}
    rename: dict[str, str] = {}
    for prefix, gs in by_prefix.items():
        container = model.get_submodule(prefix)
        keep = sorted({g.indices[0] for g in gs}, key=lambda i: list(container._modules).index(i))
        if isinstance(container, nn.ModuleDict):
            short = nn.ModuleDict({k: container[k] for k in keep})
        else:
            short = type(container)() if isinstance(container, nn.Sequential) else nn.ModuleList()
            for pos, k in enumerate(keep):
                short.add_module(str(pos), container._modules[k])
                rename[f"{prefix}.{pos}"] = f"{prefix}.{k}"
        shorts[prefix] = short
    with short_stacks(model, shorts):   # config counts follow, transformers' recorders undone (short_stack.py)
        yield rename


def remap_fqn(fqn: str, rename: dict[str, str]) -> str:
    """Real FQN of a name seen while blocks were shortened."""
    for short, real in rename.items():
        if fqn == short or fqn.startswith(short + "."):
            return real + fqn[len(short):]
    return fqn


def assign_blocks(infos: dict[str, ModuleInfo], groups: list[BlockGroup]) -> None:
    """Mark every module inside a block member with its group id."""
    member_of = {m: g.id for g in groups for m in g.member_fqns()}
    for fqn, info in infos.items():
        parts = fqn.split(".")
        for i in range(len(parts), 0, -1):
            gid = member_of.get(".".join(parts[:i]))
            if gid is not None:
                info.block = gid
                break


def block_of(fqn: str, groups: list[BlockGroup]) -> str | None:
    """Group id whose representative contains ``fqn`` (None outside blocks)."""
    for g in groups:
        if fqn == g.representative or fqn.startswith(g.representative + "."):
            return g.id
    return None

