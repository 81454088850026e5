"""Module-path patterns: the one matcher every plan key goes through.

A pattern is a dotted module path whose atoms may hold shell wildcards (``model.layers.*.mlp``,
``h.[0-3].attn``); it matches an FQN with as many atoms, atom by atom (``*`` never crosses a dot),
and ``""`` matches only the root. Plans name modules this way in parallelize_module, in the
planner's byte counts and in activation checkpointing, so one definition keeps them agreeing.
Patterns are compiled once to a regular expression: planning a 126-layer model matches tens of
thousands of (pattern, FQN) pairs.
"""
from __future__ import annotations

import functools
import re

_WILD = "*?["


def _atom(atom: str) -> str:
    out, i = [], 0
    while i < len(atom):
        c = atom[i]
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[" and "]" in atom[i + 2:] or c == "[" and atom[i + 1:i + 2] == "]":
            end = atom.index("]", i + 2)
            body = atom[i + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join(_atom(a) for a in pattern.split(".")))


@functools.lru_cache(maxsize=4096)
def _outline(pattern: str) -> tuple[int, str | None, re.Pattern | None]:
    """(number of dots, last atom if it holds no wildcard, compiled pattern if any atom does)."""
    last = pattern.rpartition(".")[2]
    wild = any(c in pattern for c in _WILD)
    return pattern.count("."), None if any(c in last for c in _WILD) else last, _compiled(pattern) if wild else None


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether module path ``fqn`` matches ``pattern`` atom by atom (see the module doc).
    Atom count and a literal last atom are checked before the expression: most (pattern, FQN)
    pairs a plan tries differ there."""
    if pattern == "" or fqn == "":
        return pattern == fqn
    dots, last, compiled = _outline(pattern)
    if compiled is None:
        return pattern == fqn
    if fqn.count(".") != dots or (last is not None and not fqn.endswith(last)):
        return False
    return compiled.fullmatch(fqn) is not None


def wildcards(pattern: str) -> int:
    """How unspecific a pattern is: the number of its atoms that contain a wildcard."""
    return sum(any(c in atom for c in _WILD) for atom in pattern.split("."))
