"""The ModelGraph IR: the model as plain data (ops, modules, repeated blocks), JSON-serialisable.

Nodes of a repeated block are stored once, for the block's representative; ``BlockGroup.count``
says how many times they run. Totals (FLOPs, bytes, parameters) multiply by that count, so an
80-layer model costs the same to hold and to solve as a one-layer one.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and strides of one tensor (no data)."""

    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype given by name ("torch.bfloat16" or "bfloat16")."""
    import torch

    name = dtype.split(".")[-1]
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        return 0
    return dt.itemsize


@dataclass
class Node:
    """One ATen op call.

    ``args``/``kwargs`` keep every non-tensor argument as JSON values; a tensor argument is
    ``{"tensor": i}``, the index into ``inputs`` (its metadata) and ``input_nodes`` (its producer:
    a node name, ``"input:<name>"``, ``"param:<fqn>"``, ``"buffer:<fqn>"`` or ``"const:<name>"``).
    ``saves`` lists the producers of activation tensors this op keeps for backward;
    ``saved_internal_bytes`` counts what it keeps that is neither an input nor an output.
    """

    name: str
    op: str
    module: str
    module_type: str
    scope: list[str]
    args: list[Any]
    kwargs: dict[str, Any]
    inputs: list[TensorMeta]
    input_nodes: list[str]
    outputs: list[TensorMeta]
    flops_fwd: int = 0
    flops_bwd: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    requires_grad: bool = False
    saved_for_backward: bool = False
    saves: list[str] = field(default_factory=list)
    saved_internal_bytes: int = 0
    block: str | None = None
    # indices into ``inputs`` whose data the op does not read (``type_as``'s ``other``: its dtype only)
    unread: list[int] = field(default_factory=list)


@dataclass
class Edge:
    """A tensor flowing from ``src`` (node or placeholder) to node ``dst``."""

    src: str
    dst: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass
class ModuleInfo:
    """One module of the model tree (every FQN, repeated layers included)."""

    fqn: str
    type: str
    params: dict[str, tuple[int, ...]]
    num_params: int
    children: list[str]
    role: str | None = None
    block: str | None = None
    # the torch.nn layer class it is an instance of (subclasses included: FalconLinear is a
    # Linear, Gemma's scaled embedding an Embedding), "" for any other module
    nn_base: str = ""
    # integer attributes named like head counts or widths, the module's own and its config's
    # ("config.num_attention_heads"): what its code may cut tensors by (blocks.size_attributes)
    size_attrs: dict[str, int] = field(default_factory=dict)
    # the keys its attention core lets each query see (autoplan.capture.key_span): ("window", w),
    # ("chunk", c), or () for every earlier key -- what the cost model prices the core's band by
    key_span: tuple = ()


@dataclass
class BlockGroup:
    """Identical sibling modules under ``prefix``; ``representative`` is the one traced."""

    id: str
    prefix: str
    indices: list[str]
    count: int
    representative: str
    module_type: str
    params_per_block: int
    roles: dict[str, Any] = field(default_factory=dict)

    def member_fqns(self) -> list[str]:
        return [f"{self.prefix}.{i}" if self.prefix else i for i in self.indices]


@dataclass
class ModelGraph:
    """The captured model. Build with :func:`autoplan.capture.capture`.

    Accessors: :meth:`total_flops`, :meth:`distinct_ops` (for op profiling),
    :meth:`module_summary` and :meth:`block_dataflow` (for the planner).
    """

    model_type: str
    nodes: list[Node]
    edges: list[Edge]
    modules: dict[str, ModuleInfo]
    blocks: list[BlockGroup]
    tied_parameters: list[list[str]]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    roles: dict[str, Any] = field(default_factory=dict)
    method: str = "export"
    warnings: list[str] = field(default_factory=list)
    num_parameters: int = 0
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------------ basic queries
    def modules_under(self, fqn: str) -> list[ModuleInfo]:
        """``fqn``'s module and every submodule of it, in name order (a bisection into the sorted
        names: the planner asks this for every unit of every search)."""
        names = self._sorted_module_names
        out = []
        for name in names[bisect.bisect_left(names, fqn):]:
            if not name.startswith(fqn):
                break
            if name == fqn or name.startswith(fqn + "."):
                out.append(self.modules[name])
        return out

    @functools.cached_property
    def _sorted_module_names(self) -> list[str]:
        return sorted(self.modules)

    def multiplicity(self, node: Node) -> int:
        """How many times ``node`` runs per forward (its block's count, else 1)."""
        if node.block is None:
            return 1
        return self.block(node.block).count

    def block(self, block_id: str) -> BlockGroup:
        for b in self.blocks:
            if b.id == block_id:
                return b
        raise KeyError(f"no block group {block_id!r}; have {[b.id for b in self.blocks]}")

    def total_flops(self, backward: bool = False) -> int:
        """Forward (or backward) FLOPs of one step over the whole model, blocks multiplied out."""
        attr = "flops_bwd" if backward else "flops_fwd"
        return sum(getattr(n, attr) * self.multiplicity(n) for n in self.nodes)

    def total_bytes(self) -> tuple[int, int]:
        """(bytes read, bytes written) of one forward, blocks multiplied out."""
        r = sum(n.bytes_read * self.multiplicity(n) for n in self.nodes)
        w = sum(n.bytes_written * self.multiplicity(n) for n in self.nodes)
        return r, w

    def traced_parameters(self) -> int:
        """Parameters the traced ops use, blocks multiplied out, ties counted once."""
        canonical = {name: g[0] for g in self.tied_parameters for name in g}
        seen: dict[str, int] = {}
        for n in self.nodes:
            for p in n.params:
                seen[canonical.get(p, p)] = self.multiplicity(n)
        total = 0
        for fqn, mult in seen.items():
            owner, _, pname = fqn.rpartition(".")
            info = self.modules.get(owner)
            if info is None or pname not in info.params:
                continue
            numel = 1
            for s in info.params[pname]:
                numel *= s
            total += numel * mult
        return total

    def nodes_in(self, fqn: str) -> list[Node]:
        """Nodes owned by module ``fqn`` or any of its submodules."""
        return [n for n in self.nodes if fqn == "" or fqn in n.scope]

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelGraph":
        def tm(d):
            return TensorMeta(
                tuple(d["shape"]), d["dtype"], tuple(d["stride"]) if d.get("stride") else None
            )

        nodes = []
        for n in data["nodes"]:
            n = dict(n)
            n["inputs"] = [tm(t) for t in n["inputs"]]
            n["outputs"] = [tm(t) for t in n["outputs"]]
            nodes.append(Node(**n))
        return cls(
            model_type=data["model_type"],
            nodes=nodes,
            edges=[Edge(**{**e, "shape": tuple(e["shape"])}) for e in data["edges"]],
            modules={
                k: ModuleInfo(**{**v, "params": {p: tuple(s) for p, s in v["params"].items()},
                                 "key_span": tuple(v.get("key_span", ()))})
                for k, v in data["modules"].items()
            },
            blocks=[BlockGroup(**b) for b in data["blocks"]],
            tied_parameters=data["tied_parameters"],
            inputs=data["inputs"],
            outputs=data["outputs"],
            roles=data.get("roles", {}),
            method=data.get("method", "export"),
            warnings=data.get("warnings", []),
            num_parameters=data.get("num_parameters", 0),
            schema_version=data.get("schema_version", SCHEMA_VERSION),
        )
