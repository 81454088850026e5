"""Elementwise chains as a compiler fuses them: which captured ops run as one kernel, and what it moves.

Eager PyTorch runs every op as its own kernel, each reading its inputs from memory and writing its
output back. ``torch.compile`` (TorchInductor) generates one kernel for a chain of elementwise ops and
reductions -- a norm, the rotary embedding, an activation times its gate, a residual add -- so the
chain reads the tensors it takes from outside once and writes the tensors that leave it once; what
passes between its ops stays in registers. GEMMs, fused attention and other library kernels stay
calls of their own (inductor's default, no max-autotune epilogues), and they bound the chains.

The chains are derived from the captured graph's dataflow, not listed per model family:

- an op fuses when inductor generates code for it -- it has a lowering or a decomposition in torch's
  own inductor tables and is no fallback to ATen (:func:`inductor_generates`) -- it does no FLOPs the
  FLOP counter counts (those are GEMMs, convolutions, attention: library calls), reads no integer
  index tensor (a gather's traffic depends on its indices) and touches no complex tensor (inductor
  has no complex code generation and falls back);
- views and reshapes are free and join the chain of what they view;
- two fusible ops joined by a tensor are one chain when no library call lies between them on any
  path: each op's *epoch* counts the library calls on its longest path from the inputs, and only ops
  of one epoch join (what inductor's own cycle check enforces: a kernel cannot both feed and wait
  for a GEMM);
- ``scope`` says what is compiled: ``"blocks"`` each repeated block on its own (torchtitan's
  per-block compile: a chain never crosses a block's boundary, and ops outside blocks stay eager),
  ``"model"`` the whole model.

A chain's forward moves its external inputs once (a slice or a broadcast read at the size it
spans) and writes each output that leaves it once (read by a library call, by an op outside the
chain, or by nothing captured: the block's output). Backward is priced as twice the forward, as
for eager ops (``autoplan`` units: ``Work.bytes``): the backward kernel reads the chain's inputs
(recomputing what lies between them, as inductor's min-cut partitioner does for pointwise ops) and
the output gradients, and writes the input gradients. The bytes of a chain are attributed to its
ops -- a read to the first op that reads the tensor, a write to the op that produces it -- so the
planner's units, each a set of captured ops, sum to the chains' total.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from cost_models.errors import CostModelError

log = logging.getLogger(__name__)

COMPILE_MODES = ("none", "blocks", "model")


class UnknownCompileModeError(CostModelError, ValueError):
    """A ``compile=`` value that names no compile mode."""


def compile_mode(value, who: str = "compile") -> str:
    """The compile mode ``value`` names: False / "none" (eager), True / "blocks" (each repeated
    block compiled on its own, as torchtitan compiles a Llama), "model" (the whole model)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "blocks"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise UnknownCompileModeError(f"{who}: compile={value!r} is not a compile mode; use a bool or one of "
                                  f"{list(COMPILE_MODES)}")


@functools.lru_cache(maxsize=None)
def _inductor_tables() -> tuple[frozenset, frozenset]:
    """(ops inductor lowers or decomposes, ops it falls back to ATen for), by their names."""
    from torch._inductor import lowering
    from torch._inductor.decomposition import select_decomp_table

    generated = {str(op) for op in lowering.lowerings} | {str(op) for op in select_decomp_table()}
    fallbacks = {str(op) for op in lowering.fallbacks}
    return frozenset(generated - fallbacks), frozenset(fallbacks)


@functools.lru_cache(maxsize=None)
def inductor_generates(op: str) -> bool:
    """Whether TorchInductor generates code for ``op`` ("aten.add.Tensor"): a lowering or a
    decomposition in its tables that is no fallback, or an op torch decomposes before inductor
    sees it (CompositeImplicitAutograd: ``type_as``, ``repeat_interleave.self_int``, ...)."""
    import torch

    name = op if op.count(".") == 2 else f"{op}.default"
    generated, fallbacks = _inductor_tables()
    if name in fallbacks:
        return False
    if name in generated:
        return True
    ns, base, overload = name.split(".")
    try:
        packet = getattr(getattr(getattr(torch.ops, ns), base), overload)
    except AttributeError:
        return False
    return packet.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def chain_passes(inputs: int, outputs: int) -> int:
    """Passes over memory a fused chain makes forward + backward, for ``inputs`` external inputs and
    ``outputs`` external outputs of one size: forward reads each input and writes each output once;
    backward likewise, twice that (the inputs again and the output gradients read, the input
    gradients written). A compiled cross entropy over the logits (one input, a scalar out): 3,
    where eager's log_softmax and nll_loss make 6."""
    return 3 * (inputs + outputs)


_INDEX_DTYPES = ("int64", "int32", "int16", "uint8")


def moves_nothing(n) -> bool:
    """An op that moves no data and runs no kernel: a getitem, or an op the capture gives no bytes
    and no FLOPs -- a view per torch's op schema, a cast to the dtype it already has (the capture
    reads bytes off the kernels an op runs: autoplan.capture.opcost), never judged by its name."""
    return n.op == "getitem" or (not n.bytes_read and not n.bytes_written and not n.flops_fwd and bool(n.input_nodes))


def fusible(n) -> bool:
    """Whether inductor would generate node ``n`` into a fused kernel (module docstring)."""
    if moves_nothing(n):
        return True
    if n.flops_fwd or not n.op.startswith("aten."):
        return False
    metas = list(n.inputs) + list(n.outputs)
    if any("complex" in m.dtype for m in metas):
        return False
    if any(m.dtype.split(".")[-1] in _INDEX_DTYPES and m.numel > 1 for m in n.inputs):
        return False
    return inductor_generates(n.op)


def _span(m) -> int:
    """Bytes a tensor's elements occupy (a broadcast dimension, stride 0, read once)."""
    stride = getattr(m, "stride", None)
    if stride is None or len(stride) != len(m.shape):
        return m.nbytes
    if any(s == 0 for s in m.shape):
        return 0
    elems = 1 + sum((n - 1) * st for n, st in zip(m.shape, stride) if st > 0)
    return min(elems, m.numel) * (m.nbytes // m.numel if m.numel else 0)


@dataclass
class Fusion:
    """The fused chains of a captured graph under one compile scope.

    ``bytes``: node name -> forward bytes (read + written) it carries as part of its chain (0 for
    an op whose traffic stays inside the chain); ``kernels``: node name -> chains it stands for
    (1 on each chain's first op that moves data); ``chains``: the chains, as node names, in graph
    order. A node in neither map runs eagerly and is priced as before.
    """

    scope: str
    bytes: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    chains: list[tuple[str, ...]] = field(default_factory=list)

    def fused(self, name: str) -> bool:
        return name in self.bytes

    def eager_bytes(self, nodes) -> float:
        """Forward bytes the chains' ops among ``nodes`` move when each runs on its own."""
        return float(sum(n.bytes_read + n.bytes_written for n in nodes if n.name in self.bytes))

    def saved_bytes(self, nodes) -> float:
        """Forward bytes fusion saves over eager among ``nodes`` (what stays in registers)."""
        return self.eager_bytes(nodes) - float(sum(self.bytes[n.name] for n in nodes if n.name in self.bytes))

    def kernels_of(self, nodes) -> tuple[int, int]:
        """(kernels, of which fused) ``nodes`` launch forward + backward, three per kernel as an eager
        op is counted (its forward and two backward): every eager op that moves data
        (:func:`moves_nothing`), and one kernel per chain."""
        fused = sum(self.kernels.get(n.name, 0) for n in nodes)
        eager = sum(1 for n in nodes if n.name not in self.bytes and not moves_nothing(n))
        return 3 * (eager + fused), 3 * fused


EAGER = Fusion("none")   # nothing compiled: every op its own kernel


def fuse(nodes, scope: str) -> Fusion:
    """The chains of ``nodes`` (a captured graph's nodes in graph order: ``name``, ``op``,
    ``inputs``, ``input_nodes``, ``outputs``, ``flops_fwd``, ``bytes_read``, ``bytes_written``,
    ``block``) compiled at ``scope`` (:data:`COMPILE_MODES`)."""
    scope = compile_mode(scope, "fuse")
    out = Fusion(scope)
    if scope == "none":
        return out
    by_name = {n.name: n for n in nodes}
    compiled = {n.name for n in nodes if (scope == "model" or n.block is not None) and fusible(n)}
    # epoch: library calls on the longest path from the inputs (module docstring)
    epoch: dict[str, int] = {}
    for n in nodes:
        e = 0
        for p in n.input_nodes:
            if p in epoch:
                e = max(e, epoch[p] + (0 if p in compiled else 1))
        epoch[n.name] = e
    parent = {name: name for name in compiled}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for p in n.input_nodes:
            if p in by_name:
                consumers.setdefault(p, []).append(n.name)
            if (n.name in compiled and p in compiled and epoch[p] == epoch[n.name]
                    and (scope == "model" or by_name[p].block == n.block)):
                parent[root(p)] = root(n.name)
    members: dict[str, list[str]] = {}
    for n in nodes:
        if n.name in compiled:
            members.setdefault(root(n.name), []).append(n.name)
    for names in members.values():
        chain = set(names)
        moved = [x for x in names if not moves_nothing(by_name[x])]
        if not moved:
            continue
        for x in names:
            out.bytes[x] = 0.0
        out.kernels[moved[0]] = 1
        out.chains.append(tuple(names))
        for x, size in _reads(names, chain, by_name):
            out.bytes[x] += size
        for x in moved:
            if _leaves(x, chain, consumers, by_name):
                out.bytes[x] += float(sum(o.nbytes for o in by_name[x].outputs))
    return out


def chain_outputs(chain, by_name: dict) -> list[str]:
    """The ops of ``chain`` whose outputs leave it (what its kernel writes), in graph order."""
    members = set(chain)
    consumers: dict[str, list[str]] = {}
    for n in by_name.values():
        for p in n.input_nodes:
            consumers.setdefault(p, []).append(n.name)
    return [x for x in chain if not moves_nothing(by_name[x]) and _leaves(x, members, consumers, by_name)]


def _reads(names: list[str], chain: set, by_name: dict) -> list[tuple[str, float]]:
    """(first reader, bytes) of each tensor ``chain`` takes from outside, read once: a direct read at
    the size the tensor spans; reads through views at what each distinct view spans (the q, k and v
    slices of a fused projection are three reads; two casts of one input one), never more than the
    whole tensor."""
    first: dict[str, str] = {}
    whole: dict[str, float] = {}
    direct: set = set()
    parts: dict[str, dict] = {}
    for x in names:
        n = by_name[x]
        view = moves_nothing(n)
        unread = set(getattr(n, "unread", ()))   # inputs whose data the op does not read (their dtype only)
        for i, (p, m) in enumerate(zip(n.input_nodes, n.inputs)):
            if p in chain or i in unread:
                continue
            first.setdefault(p, x)
            whole[p] = max(whole.get(p, 0.0), float(_span(m)))
            if view and n.outputs:
                key = (tuple(n.outputs[0].shape), repr(n.args[1:]))
                parts.setdefault(p, {})[key] = float(min(_span(m), sum(_span(o) for o in n.outputs)))
            else:
                direct.add(p)
    return [(first[p], whole[p] if p in direct else min(whole[p], sum(parts[p].values()))) for p in first]


def _leaves(name: str, chain: set, consumers: dict, by_name: dict) -> bool:
    """Whether ``name``'s output is read outside ``chain`` (through views of it in the chain too),
    or by nothing captured (a block's output, read by the next block)."""
    seen, todo = set(), [name]
    while todo:
        x = todo.pop()
        users = consumers.get(x, [])
        if not users:   # nothing captured reads it (or a view of it): the block's or graph's output
            return True
        for u in users:
            if u not in chain:
                return True
            if u not in seen and moves_nothing(by_name[u]):
                seen.add(u)
                todo.append(u)
    return False
