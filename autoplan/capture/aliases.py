"""In-place writes into views, as dataflow edges the role tracing can follow.

A captured graph is not always functional: DeepSeek's MLA builds its keys as
``k = kv.new_empty(...)`` and fills them with ``k[..., :nope].copy_(k_nope)`` and
``k[..., nope:].copy_(k_rot)``. The attention core's key input is then the ``new_empty`` node,
whose only graph input is a shape template; the data arrives through the two ``copy_`` nodes,
which write into *views* of it. Following node inputs alone, the keys come from nowhere.

So every node is mapped to the buffer it views (its alias root: the first non-view node under
a chain of views), and every in-place op (ATen's trailing underscore: ``copy_``, ``add_``,
``fill_``...) is recorded as a write into its first argument's buffer. A read of a buffer then
depends on the writes into it that ran before the read, in graph (execution) order, as if they
were inputs of the tensor read. That is the exact dependence for a straight-line graph.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autoplan.capture.ir import Node

# ops whose output shares its first input's storage (reshape and contiguous may copy: excluded,
# so a write into their result is not taken for a write into the source)
_VIEWS = ("view", "_unsafe_view", "slice", "select", "narrow", "transpose", "permute", "expand", "unsqueeze",
          "squeeze", "alias", "t", "as_strided", "diagonal", "unflatten", "split", "split_with_sizes", "chunk",
          "unbind", "detach", "getitem", "view_as", "movedim")


def op_base(op: str) -> str:
    """An op's name without namespace and overload ("aten.copy_.default" -> "copy_")."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else op


def is_inplace(node: Node) -> bool:
    """An ATen op that mutates its first argument (``copy_``, ``add_``; not ``_softmax``)."""
    base = op_base(node.op)
    return node.op.startswith("aten.") and base.endswith("_") and not base.startswith("_") and \
        bool(node.input_nodes)


@dataclass
class Aliases:
    """Alias roots and the in-place writes into each buffer, in graph order."""

    position: dict[str, int] = field(default_factory=dict)
    root: dict[str, str] = field(default_factory=dict)
    writes: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def buffer(self, name: str) -> str:
        return self.root.get(name, name)

    def members(self, buffer: str) -> list[str]:
        """The buffer and every node that views it (in-place writes included)."""
        return [buffer] + [n for n, r in self.root.items() if r == buffer]

    def writes_before(self, name: str, position: float) -> list[str]:
        """The in-place nodes writing into the buffer ``name`` views that run before ``position``
        (the reader's place in the graph), excluding ``name`` itself."""
        return [w for w in self.writes.get(self.buffer(name), ()) if self.position[w] < position and w != name]


def aliases(nodes: list[Node]) -> Aliases:
    """Alias roots and in-place writes of a captured graph (nodes in execution order)."""
    out = Aliases()
    for i, n in enumerate(nodes):
        out.position[n.name] = i
        src = n.input_nodes[0] if n.input_nodes else None
        if src is not None and (is_inplace(n) or op_base(n.op).startswith(_VIEWS)):
            out.root[n.name] = out.root.get(src, src)
        if is_inplace(n):
            out.writes[out.root.get(src, src)].append(n.name)
    return out
