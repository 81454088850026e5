"""Read-only JSON containers: what a sealed Plan's sections are made of.

A plan is data a person reviews and a runtime applies; once built it must not change under
either of them. Sealing the Plan object refuses assignment to its fields, but its sections are
dicts and lists a caller could still edit in place (``plan.model["source"] = ...``). Sealing
therefore also turns every nested dict and list into these subclasses: they read, compare,
iterate and serialise exactly as ``dict`` / ``list`` (json, pandas and ``==`` see no difference),
and every in-place change raises ``PlanSealedError`` naming the way to make a changed copy.
Pickling and copying give them back frozen (a plan sent to a spawned rank stays sealed);
``thaw`` gives plain, editable containers for a draft.
"""
from __future__ import annotations

from typing import Any, NoReturn

from autoplan.errors import PlanSealedError


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise PlanSealedError("a sealed plan's sections are read-only; make a changed copy with plan.replace(<field>=...) "
                          "(e.g. plan.replace(model=dict(plan.model, source=...))), or build it in autoplan.assembler")


class _Value:
    """What a read-only container shares: it is its own copy (nothing can change it), and it
    pickles as its plain base type, rebuilt frozen (unpickling a dict subclass would otherwise
    fill it item by item through the refused ``__setitem__``)."""

    __slots__ = ()
    _plain: type

    def __reduce__(self):
        return (type(self), (self._plain(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo: dict):
        return self


class FrozenDict(_Value, dict):
    """A ``dict`` whose contents cannot change."""

    __slots__ = ()
    _plain = dict
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse


class FrozenList(_Value, list):
    """A ``list`` whose contents cannot change."""

    __slots__ = ()
    _plain = list
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse


def freeze(value: Any) -> Any:
    """``value`` with every dict and list inside it (tuples read as lists) made read-only."""
    if isinstance(value, FrozenDict | FrozenList):
        return value
    if isinstance(value, dict):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return FrozenList(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Plain, editable dicts and lists (tuples become lists) of ``value``, copied all the way down."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
