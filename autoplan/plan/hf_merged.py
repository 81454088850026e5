"""Model tensors that transformers assembles from several file tensors, read slice by slice.

transformers 5 writes an MoE's experts one 2-D tensor per expert and fuses them on load with a
converter's operations -- ``MergeModulelist(dim)`` stacks a module list's tensors, ``Concatenate(dim)``
joins the source patterns' results (gate | up). Both only place whole file tensors into boxes of
the model tensor, so no rank needs the fused tensor: :func:`assemble` replays the converter's own
operations on the headers' shapes (the layout comes from the converter's patterns and its
operations' ``dim``, never from a table of families) and gives each file tensor's box; then
:func:`read_assembled` intersects the boxes with the global indices a rank's shard holds and reads
only the intersecting sub-boxes (``SafetensorsFile.read`` of a slice). A rank holding half the
experts reads half the expert bytes; an expert-TP shard (each rank its slice of the gate and of the
up half: a strided shard, not one block) reads two sub-boxes per expert, no whole tensor.

:func:`assemble` runs on the headers alone, before any weight is read, so every rank reaches the
same verdict: an expert missing (named by its file key and the model tensor), a piece of another
shape than its siblings, or an assembled shape that is not the model's raise
:class:`~autoplan.errors.PretrainedWeightsError`.
"""
from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.errors import PretrainedWeightsError
from autoplan.plan.hf_keys import KeyTarget, MergeSlot, placing_ops
from autoplan.plan.safetensors_slices import SafetensorsFile
from hyper_parallel.core.dtensor.blocks import holds_one_block

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """One file tensor's box in the assembled tensor: ``offsets``/``sizes`` per assembled dim;
    ``inserted`` are the dims a stack added (size 1, not dims of the file tensor)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    inserted: tuple[int, ...] = ()


@dataclass
class Assembled:
    """A model tensor made of file tensors: its shape and every piece (file key, box)."""

    name: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)
    converter: object = None

    @property
    def first_key(self) -> str:
        return self.pieces[0].key


@dataclass
class _Sym:
    """A tensor during the replay: its shape and where its pieces lie in it."""

    shape: tuple[int, ...]
    pieces: list[Piece]


def _stack(items: list[tuple[int | None, _Sym]], dim: int, name: str, converter) -> _Sym:
    """``torch.stack(items, dim)`` on shapes: item j's pieces gain a size-1 dim at ``dim``, offset j."""
    shapes = Counter(s.shape for _, s in items)
    common = shapes.most_common(1)[0][0]
    for _, s in items:
        if s.shape != common:
            raise PretrainedWeightsError(
                f"pretrained weights: file tensor {s.pieces[0].key!r} has shape {s.shape}, its siblings {common} "
                f"(stacked into the model's {name!r} by {converter!r})", name=s.pieces[0].key,
                expected=common, found=s.shape)
    dim = dim + len(common) + 1 if dim < 0 else dim
    pieces = []
    for j, (_, s) in enumerate(items):
        for p in s.pieces:
            pieces.append(Piece(p.key, p.offsets[:dim] + (j,) + p.offsets[dim:], p.sizes[:dim] + (1,) + p.sizes[dim:],
                                tuple(sorted([d + (d >= dim) for d in p.inserted] + [dim]))))
    return _Sym(common[:dim] + (len(items),) + common[dim:], pieces)


def _concat(items: list[_Sym], dim: int, name: str, converter) -> _Sym:
    """``torch.cat(items, dim)`` on shapes: each item's pieces move along ``dim`` by the sizes before it."""
    first = items[0].shape
    dim = dim + len(first) if dim < 0 else dim
    pieces, at = [], 0
    for s in items:
        if len(s.shape) != len(first) or s.shape[:dim] + s.shape[dim + 1:] != first[:dim] + first[dim + 1:]:
            raise PretrainedWeightsError(
                f"pretrained weights: file tensor {s.pieces[0].key!r} gives {s.shape} where {converter!r} "
                f"concatenates along dim {dim} with {first} for the model's {name!r}", name=s.pieces[0].key,
                expected=first, found=s.shape)
        for p in s.pieces:
            pieces.append(Piece(p.key, p.offsets[:dim] + (p.offsets[dim] + at,) + p.offsets[dim + 1:], p.sizes,
                                p.inserted))
        at += s.shape[dim]
    return _Sym(first[:dim] + (at,) + first[dim + 1:], pieces)


def _missing_key(sibling: str, have: int, want: int, name: str, pattern: str, rename: Callable[[str], KeyTarget]) -> str:
    """The file key expert ``want`` would have: ``sibling`` (expert ``have``) with its index changed
    where the renaming then finds ``want`` (a layer index may equal the expert index)."""
    parts = sibling.split(".")
    for i, part in enumerate(parts):
        if part == str(have):
            candidate = ".".join(parts[:i] + [str(want)] + parts[i + 1:])
            try:
                new, slot = rename(candidate)
            except PretrainedWeightsError:
                continue
            if new == name and slot is not None and slot.pattern == pattern and slot.index == want:
                return candidate
    return f"<{pattern} with index {want}>"


def _missing(name: str, key: str, shape, converter, what: str) -> PretrainedWeightsError:
    return PretrainedWeightsError(
        f"pretrained weights: file tensor {key!r} is not in the files ({what} of the model's {name!r}, shape "
        f"{shape}, assembled by {converter!r}); is the checkpoint complete?", name=key, expected=shape)


def assemble(name: str, keys: list[tuple[str, MergeSlot]], stored: dict, expected: tuple[int, ...] | None,
             rename: Callable[[str], KeyTarget]) -> Assembled:
    """Replay the converter's operations on the file tensors' shapes (``stored``: key -> (shape,
    dtype, file)) and return every piece's box in ``name``. ``expected``: the model's shape (None
    when the model has no such tensor: the caller's check names it)."""
    converter = keys[0][1].converter
    by_pattern: dict[str, dict[int | None, str]] = {}
    for key, slot in keys:
        if slot.converter is not converter:
            raise PretrainedWeightsError(f"pretrained weights: the model's {name!r} is assembled by two converters "
                                         f"({converter!r}, {slot.converter!r})", name=name)
        seen = by_pattern.setdefault(slot.pattern, {})
        if slot.index in seen:
            raise PretrainedWeightsError(f"pretrained weights: file tensors {seen[slot.index]!r} and {key!r} both "
                                         f"give piece {slot.index} of the model's {name!r}", name=key)
        seen[slot.index] = key
    patterns = [p for p in converter.source_patterns if p in by_pattern]
    absent = [p for p in converter.source_patterns if p not in by_pattern]
    if absent:
        raise _missing(name, f"<{absent[0]}>", expected, converter, "no file tensor matches this source pattern")
    listed = {p: i for p, i in by_pattern.items() if None not in i}
    count = max((max(i) + 1 for i in listed.values()), default=0)
    values: dict[str, object] = {}
    for pattern in patterns:
        found = by_pattern[pattern]
        if pattern not in listed:
            key = found[None]
            values[pattern] = _Sym(stored[key][0], [Piece(key, (0,) * len(stored[key][0]), stored[key][0])])
            continue
        gap = next((j for j in range(count) if j not in found), None)
        if gap is not None:
            have = next(iter(found))
            raise _missing(name, _missing_key(found[have], have, gap, name, pattern, rename), expected, converter,
                           f"piece {gap} of {count}")
        values[pattern] = [(j, _Sym(stored[found[j]][0], [Piece(found[j], (0,) * len(stored[found[j]][0]),
                                                                   stored[found[j]][0])])) for j in range(count)]
    merge, stacked = _replay(values, converter, name)
    if expected is not None and merge.shape != tuple(expected):
        for axis in stacked:   # experts missing at the end of every list: name the first
            if axis < len(expected) and merge.shape[axis] < expected[axis] and listed:
                pattern = next(iter(listed))
                have = next(iter(by_pattern[pattern]))
                key = _missing_key(by_pattern[pattern][have], have, merge.shape[axis], name, pattern, rename)
                raise _missing(name, key, expected, converter, f"piece {merge.shape[axis]} of {expected[axis]}")
        raise PretrainedWeightsError(
            f"pretrained weights: the model's {name!r} is {tuple(expected)}; {converter!r} assembles "
            f"{merge.shape} from the files (e.g. {merge.pieces[0].key!r}, shape {stored[merge.pieces[0].key][0]})",
            name=name, expected=tuple(expected), found=merge.shape, file=stored[merge.pieces[0].key][2])
    return Assembled(name, merge.shape, merge.pieces, converter)


def _replay(values: dict[str, object], converter, name: str) -> tuple[_Sym, list[int]]:
    """The converter's operations on ``values`` as transformers runs them (core_model_loading:
    MergeModulelist keeps the source patterns' keys while more than one is left, Concatenate joins
    them in source-pattern order); also the dims the stacks added."""
    stack_op, concat_op = placing_ops()
    stacked: list[int] = []
    for op in converter.operations:
        if type(op) is stack_op:
            n = len(values)
            out = {}
            for pattern, v in values.items():
                target = converter.target_patterns[0] if n == 1 else pattern
                if isinstance(v, list):
                    out[target] = _stack(v, op.dim, name, converter)
                    stacked.append(op.dim if op.dim >= 0 else op.dim + len(out[target].shape))
                else:
                    out[target] = v
            values = out
        elif type(op) is concat_op:
            items: list[_Sym] = []
            for pattern in converter.source_patterns:
                v = values.pop(pattern, None)
                if v is not None:
                    items.extend(s for _, s in v) if isinstance(v, list) else items.append(v)
            values = {converter.target_patterns[0]: _concat(items, op.dim, name, converter)}
        else:   # hf_keys refuses these keys first; kept for a converter changed after that check
            raise PretrainedWeightsError(f"pretrained weights: {converter!r} applies {op!r} to the model's {name!r}, "
                                         "which computes new values", name=name)
    result = list(values.values())
    if len(result) != 1 or not isinstance(result[0], _Sym):
        raise PretrainedWeightsError(f"pretrained weights: {converter!r} does not give one tensor for the model's "
                                     f"{name!r} ({len(result)} results)", name=name)
    return result[0], stacked


def held_indices(t: torch.Tensor) -> list:
    """Per dim, the global indices of the rows this rank's local tensor holds, in local order: a
    ``range`` for a plain tensor or one block (DTensor's offset); otherwise each dim's placements
    applied to that dim's ``arange`` alone (placements on different dims act independently), as
    ``local_slice`` cuts a strided shard."""
    if not isinstance(t, DTensor):
        return [range(n) for n in t.shape]
    if holds_one_block(t.placements):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [range(o, o + n) for n, o in zip(shape, offset)]
    out = []
    for d, n in enumerate(t.shape):
        mapped = []
        for p in t.placements:
            if isinstance(p, _StridedShard) and p.dim == d:
                mapped.append(_StridedShard(0, split_factor=p.split_factor))
            elif isinstance(p, Shard) and p.dim == d:
                mapped.append(Shard(0))
            else:
                mapped.append(Replicate())
        out.append(distribute_tensor(torch.arange(n), t.device_mesh, mapped, src_data_rank=None).to_local())
    return out


def _runs(index, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of the runs of ``index`` inside [lo, hi) that are
    consecutive both locally and globally (one at most for a ``range``)."""
    if isinstance(index, range):
        start, stop = max(lo, index.start), min(hi, index.stop)
        return [(start - index.start, start, stop - start)] if stop > start else []
    pos = ((index >= lo) & (index < hi)).nonzero().flatten()
    if pos.numel() == 0:
        return []
    g = index[pos]
    breaks = (((pos[1:] - pos[:-1]) != 1) | ((g[1:] - g[:-1]) != 1)).nonzero().flatten() + 1
    starts = [0] + breaks.tolist()
    ends = starts[1:] + [pos.numel()]
    return [(int(pos[s]), int(g[s]), e - s) for s, e in zip(starts, ends)]


def read_assembled(t: torch.Tensor, a: Assembled, files: dict[str, SafetensorsFile], file_of: dict[str, str]) -> int:
    """Read into ``t`` (a held tensor: its local shard is written) every sub-box of ``a``'s pieces
    it holds, cast to its dtype. Returns the bytes read from the files."""
    local = t.to_local() if isinstance(t, DTensor) else t
    index = held_indices(t)
    done = 0
    with torch.no_grad():
        for p in a.pieces:
            per_dim = []
            for d, (o, n) in enumerate(zip(p.offsets, p.sizes)):
                per_dim.append(_runs(index[d], o, o + n))
                if not per_dim[-1]:   # this rank holds nothing of the piece (another rank's expert)
                    break
            if per_dim and not per_dim[-1]:
                continue
            f = files[file_of[p.key]]
            for box in itertools.product(*per_dim):
                keep = [d for d in range(len(box)) if d not in p.inserted]
                part = f.read(p.key, [box[d][1] - p.offsets[d] for d in keep], [box[d][2] for d in keep])
                done += part.numel() * part.element_size()
                view = local
                for d, (start, _, n) in enumerate(box):
                    view = view.narrow(d, start, n)
                view.copy_(part.reshape([r[2] for r in box]).to(local.dtype))
    return done
