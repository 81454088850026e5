"""A model's own MoE routing, run on fake tensors as the balanced router would route.

Two fake runs need it: the pipeline splitter's trace of the forward (``forward_split``) and
verify's dry runs. Verify's dry run executes the plan under FakeTensorMode with routing fixed to the balanced
assignment (hyper_parallel's ``balanced_routing()``). The expert styles that replace an experts
module's forward (ExpertParallel and its tp form) follow it from sizes alone, so Mixtral, Qwen3-MoE
or OLMoE never run their own expert loop in the dry run. A module whose own loop stays in place --
DBRX's flat experts under FlatExpertsParallel, which only splits the weights and wraps the forward
-- picks each expert's tokens with ``nonzero`` / ``torch.where`` on its routing mask: an output
shape set by values, which fake tensors do not hold (``DynamicOutputShapeException``). Unbacked
symbolic sizes (a ShapeEnv) do not rescue it either: the loop's trip count (``for e in
expert_hit``) is such a size, and the collectives' bytes must be numbers to be compared.

So this mode gives the routing its values. Each ``topk`` output's indices get the balanced
assignment as a real value (copy i of token t to expert ``(t*k + i) % E``, what ExpertParallel routes
by under ``balanced_routing()``), and so do integer and bool tensors created from sizes alone
(``zeros`` / ``arange``: ``one_hot`` builds its mask so). Any op whose tensor inputs all have values
is run on the values as well (on the CPU, outside every mode) and its integer / bool outputs keep
theirs: the mask, its ``nonzero``, the per-expert token indices and every read of them (``.item()``,
``if idx == E``) are then what the balanced router gives, and an op with a data-dependent shape gets
a fake output of the real result's shape. Floating tensors never get values (activations,
weights); neither do tensors above ``MAX_NUMEL`` elements, nor ones an op writes from inputs without
values. Routing-sized tensors only, so the dry run still allocates nothing activation-sized.

A mask with values may also pick rows of a tensor without them: Qwen3-VL adds its DeepStack
features at the image tokens (``hidden[mask, :] += features``, the mask made from the token ids the
dry run built). The op's data has no value to run on, but its output size is the mask's count,
and torch's fake ``nonzero`` (which every boolean index goes through) takes that count from the
mask's ``nonzero_memo``: set from the value before each op, it gives a number, so the sizes after
it -- and the collectives' bytes -- stay numbers. That needs the fake mode to have a shape
environment (``nonzero`` refuses without one; ``static_shapes=True`` keeps every other size
static, as the verify dry runs make theirs). A data-shaped op whose size no value decides would
then make an unbacked symbolic size, which a collective's bytes cannot be: it is refused as it was
without one (``DynamicOutputShapeException``).
"""
from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.core.expert_parallel.routing import balanced_assignment

log = logging.getLogger(__name__)
aten = torch.ops.aten
_ATTR = "_autoplan_routed_value"
MAX_NUMEL = 1 << 26   # 64M elements: a mask of 16k tokens x top-8 x 257 experts; above it no value is kept
_READS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default)
_DATA_SHAPED = (DynamicOutputShapeException, DataDependentOutputException)
_NONZERO = (aten.nonzero.default, aten.argwhere.default, aten.nonzero_numpy.default)


def value_of(t: object) -> torch.Tensor | None:
    """The real value a fake tensor carries (a plain real tensor is its own value); None if none."""
    if isinstance(t, FakeTensor):
        return getattr(t, _ATTR, None)
    if type(t) is torch.Tensor and not t.is_meta:
        return t
    return None


def _keeps_value(t: object) -> bool:
    if not isinstance(t, FakeTensor) or t.dtype.is_floating_point or t.dtype.is_complex:
        return False
    n = t.numel()   # an unbacked size (a data-shaped op no value decided) is no routing-sized number
    return isinstance(n, int) and n <= MAX_NUMEL


def _count_masks(func, tensors: list) -> None:
    """Each bool fake tensor with a value (any such tensor for ``nonzero`` itself): its count of
    nonzeros as the memo torch's fake ``nonzero`` reads, so an op indexing a tensor without values
    by it gets a fixed size (see the module docstring). Set before every op: torch drops the memo
    when the tensor is written."""
    for t in tensors:
        if isinstance(t, FakeTensor) and (t.dtype == torch.bool or func in _NONZERO) and not t.is_inference():
            value = value_of(t)
            if value is not None and t.nonzero_memo is None:
                with no_dispatch():   # counted on the value, not by the modes below (EvenCounts would say 0)
                    t.nonzero_memo = int(torch.count_nonzero(value))


def _unbacked(out) -> bool:
    """Whether an op's output has a size that is not a number (an unbacked symbol)."""
    return any(isinstance(o, torch.Tensor) and not all(isinstance(d, int) for d in o.shape)
               for o in tree_flatten(out)[0])


def _on_cpu(x: object) -> object:
    """An argument for the real computation: tensors as their values, devices as the CPU."""
    if isinstance(x, torch.Tensor):
        return value_of(x)
    if isinstance(x, torch.device):
        return torch.device("cpu")
    return x


class OwnRouting(TorchDispatchMode):
    """Balanced values for routing tensors, carried through the model's own ops; see module doc."""

    def __init__(self):
        super().__init__()
        self.computed = 0   # ops run on values (a test reads it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        known = all(value_of(t) is not None for t in tensors)
        if known and tensors and func in _READS:   # `if idx == E`, `.item()`, `.tolist()`
            return self._real(func, args, kwargs)
        _count_masks(func, tensors)   # any op may index by a mask (index_put_ is not tagged data-shaped)
        shaped_by_data = torch.Tag.dynamic_output_shape in func.tags
        try:
            if shaped_by_data and known and tensors:   # the values give the size (as without a shape env)
                raise DynamicOutputShapeException(func)
            out = func(*args, **kwargs)
            if shaped_by_data and _unbacked(out):   # no value decided its size: refused (module doc)
                raise DynamicOutputShapeException(func)
        except _DATA_SHAPED as shaped:
            if not (known and tensors):
                raise
            try:
                real = self._real(func, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - the values do not run it either: the fake tensors' error stands
                raise shaped from exc
            device = next((t.device for t in tensors if isinstance(t, FakeTensor)), torch.device("cpu"))
            out = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
                           if isinstance(r, torch.Tensor) else r, real)
            self._attach(out, real)
            return out
        if func is aten.topk.default:
            self._seed(args, kwargs, out)
        elif known and any(_keeps_value(o) for o in tree_flatten(out)[0]):
            try:
                self._attach(out, self._real(func, args, kwargs))
            except Exception as exc:  # noqa: BLE001 - a value it cannot compute: the tensor goes without one
                log.debug("dry run: %s not run on values (%s)", func, exc)
                self._forget(func, args, kwargs)
        else:   # nothing computed: a tensor it wrote keeps no stale value
            self._forget(func, args, kwargs)
        return out

    def _real(self, func, args, kwargs):
        self.computed += 1
        real_args, real_kwargs = tree_map(_on_cpu, (args, kwargs))
        with no_dispatch():
            return func(*real_args, **real_kwargs)

    @staticmethod
    def _attach(out, real) -> None:
        outs, reals = tree_flatten(out)[0], tree_flatten(real)[0]
        for o, r in zip(outs, reals):
            if isinstance(r, torch.Tensor) and _keeps_value(o):
                setattr(o, _ATTR, r)

    @staticmethod
    def _forget(func, args, kwargs) -> None:
        """An op writing a tensor from inputs without values: the tensor's value is stale now."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(t, FakeTensor) and hasattr(t, _ATTR):
                delattr(t, _ATTR)

    @staticmethod
    def _seed(args, kwargs, out) -> None:
        """topk over the last dimension: its indices are the balanced assignment of the rows."""
        scores, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        indices = out[1]
        if not isinstance(indices, FakeTensor) or scores.ndim == 0 or dim % scores.ndim != scores.ndim - 1 or \
                not _keeps_value(indices):
            return
        experts = scores.shape[-1]
        rows = scores.numel() // experts if experts else 0
        with no_dispatch():   # a real tensor, not one the fake mode below would make
            value = balanced_assignment(rows, int(k), experts, "cpu").view(indices.shape)
        setattr(indices, _ATTR, value)
