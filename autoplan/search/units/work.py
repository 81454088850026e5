"""What a module costs to run, as the planner prices it: its FLOPs, the GEMMs among them at the
shapes they run (fused attention tagged causal or not), the bytes of everything else, and the
activations its backward keeps -- read off the captured graph's nodes. The units the planner
builds from the model (structure.py) each carry one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from autoplan.capture.ir import ModelGraph, dtype_size
from autoplan.capture.views import module_summary
from cost_models.fusion import EAGER, Fusion, moves_nothing
from cost_models.compute import (
    ATTENTION, ATTENTION_CAUSAL, causal_density, gemm_shape_dims, gemm_split, is_attention_op,
)


@dataclass
class Work:
    """Cost inputs of one module (per call): FLOPs, bytes moved, activation bytes saved, kernels."""

    flops: float = 0.0          # forward + backward
    bytes: float = 0.0          # forward read + written, backward taken as twice forward
    saved: float = 0.0
    kernels: int = 0
    params: int = 0
    param_bytes: int = 0
    # per op class, for cost_models' compute pricing: (flops fwd+bwd, M, N, K, split) of each GEMM
    # or fused-attention op -- split names the dimension a tensor-parallel shard divides
    # (cost_models.compute.gemm_split) -- and the bytes of every other non-view op (fwd + bwd)
    gemms: tuple = ()
    other_bytes: float = 0.0
    # the attention core (ops of the attention module itself, not of its projections): what
    # selective recomputation recomputes and stops saving -- its ``saved`` is the bytes that frees:
    # what the core's ops save, less the projection outputs they read, which the checkpoint keeps
    core: "Work | None" = None
    # of ``kernels``, those that are compiled fused chains (cost_models.fusion), priced at the
    # profile's compiled-kernel cost where it measured one
    fused_kernels: int = 0

    def __add__(self, o: "Work") -> "Work":
        core = self.core if o.core is None else (o.core if self.core is None else self.core + o.core)
        return Work(self.flops + o.flops, self.bytes + o.bytes, self.saved + o.saved,
                    self.kernels + o.kernels, self.params + o.params, self.param_bytes + o.param_bytes,
                    self.gemms + o.gemms, self.other_bytes + o.other_bytes, core,
                    self.fused_kernels + o.fused_kernels)



# The loss is no part of the captured graph (capture runs the model's forward only), yet over a
# large vocabulary it is one of a step's largest memory-bound ops. The runners call torch's
# F.cross_entropy on the logits in their dtype (autoplan/plan/forward.py): log_softmax forward reads
# and writes the logits, nll_loss backward writes a dense gradient, log_softmax backward reads two and
# writes one -- six logits-sized passes. Another runtime's loss is stated in bytes per logit (e.g.
# Megatron-Core's fp32 vocab-parallel cross entropy, benchmarks/moe_published_runs.py).
CROSS_ENTROPY_PASSES = 6


def loss_work(tokens: int, vocab: int, bytes_per_logit: float) -> Work:
    """The cross-entropy loss over ``tokens`` x ``vocab`` logits, forward + backward, priced by its
    HBM traffic (``bytes_per_logit`` read + written in all) and its four kernels each way."""
    nbytes = float(tokens) * vocab * bytes_per_logit
    return Work(bytes=nbytes, other_bytes=nbytes, kernels=8)


def work_of(graph: ModelGraph, fqn: str, rows: dict, fusion: Fusion = EAGER) -> Work:
    """``fqn``'s work; ``fusion``: the graph's compiled chains (cost_models.fusion), whose ops move
    their chain's bytes and launch its kernels instead of their own."""
    row = rows.get(fqn)
    if row is None:
        return Work()
    nodes = graph.nodes_in(fqn)
    pbytes = 0
    info = graph.modules.get(fqn)
    for sub, m in graph.modules.items():
        if sub == fqn or sub.startswith(fqn + "."):
            for shape in m.params.values():
                n = 1
                for s in shape:
                    n *= s
                pbytes += n * 4  # refined by the caller with the model dtype
    fwd_bytes = float(row["bytes_read"] + row["bytes_written"])
    causal = causal_lm(graph)
    gemms, other = _op_classes(nodes, causal, graph.modules, fusion)
    core_nodes = [n for n in nodes if n.module == fqn]
    core = None
    if core_nodes and any(_op_classes([n])[0] for n in core_nodes):  # a module that runs its own matmuls
        cg, co = _op_classes(core_nodes, causal, graph.modules, fusion)
        ck, cf = fusion.kernels_of(core_nodes)
        saved = sum(n.saved_internal_bytes + (sum(t.nbytes for t in n.outputs) if n.saved_for_backward else 0)
                    for n in core_nodes)
        core = Work(flops=float(sum(n.flops_fwd + n.flops_bwd for n in core_nodes)), bytes=0.0,
                    saved=float(max(saved - _kept_inputs(fqn, nodes, core_nodes), 0)),
                    kernels=ck, gemms=cg, other_bytes=co, fused_kernels=cf)
    kernels, fused = fusion.kernels_of(nodes)
    return Work(flops=float(row["flops_fwd"] + row["flops_bwd"]), bytes=3.0 * (fwd_bytes - fusion.saved_bytes(nodes)),
                saved=float(row["saved_bytes"]), kernels=kernels, fused_kernels=fused,
                params=int(row["num_params"]), param_bytes=pbytes if info else 0,
                gemms=gemms, other_bytes=other, core=core)


def module_work(graph: ModelGraph, fqn: str, rows: dict | None = None) -> Work:
    """Cost inputs of module ``fqn`` per call (``rows``: module_summary rows by FQN, computed
    when not given), parameter bytes in the model's dtype -- what model_structure gives its units,
    for modules that are no unit of the TP search (MoE experts containers)."""
    rows = rows if rows is not None else {r["fqn"]: r for r in module_summary(graph).to_dict("records")}
    w = work_of(graph, fqn, rows)
    float_dtypes = [o.dtype for n in graph.nodes for o in n.outputs if "float" in o.dtype]
    w.param_bytes = w.params * (dtype_size(float_dtypes[0]) if float_dtypes else 4)
    return w


def _kept_inputs(fqn: str, nodes, core_nodes) -> int:
    """Bytes of the child modules' outputs (the q/k/v projections) that the attention core reads:
    selective recomputation (autoplan.parallelisms.recompute, as Megatron-LM's) keeps them saved to
    recompute the core from, so they are not freed with it -- Korthikanti et al.'s 34*s*b*h per
    layer under selective recomputation counts them (Q, K, V: 6*s*b*h of it for multi-head)."""
    by_name = {n.name: n for n in nodes}
    producers = {src for n in core_nodes for src in n.input_nodes
                 if src in by_name and by_name[src].module.startswith(fqn + ".")}
    return sum(t.nbytes for src in producers for t in by_name[src].outputs)


_CAUSAL_ROOTS = ("ForCausalLM", "LMHeadModel")   # transformers' decoder-only heads: self-attention is causal


def causal_lm(graph: ModelGraph) -> bool:
    """The captured model is a decoder-only language model (a transformers ``*ForCausalLM`` /
    ``*LMHeadModel``), whose self-attention runs under a causal mask -- transformers materialises
    that mask as a (b, 1, s, s) tensor on meta, where a real run passes ``is_causal``."""
    return graph.model_type.endswith(_CAUSAL_ROOTS)


def _attention_tag(n, dims, causal_model: bool, span: tuple = ()) -> tuple[str, float]:
    """(tag, density) of a fused attention op: ATTENTION_CAUSAL for one computing a causal mask's
    band of the scores (``is_causal=True``, or self-attention of a causal LM: s_q == s_k), the
    band narrowed by its module's key span (a sliding window or chunk, ``ModuleInfo.key_span``);
    else ATTENTION, the whole matrix. The density is the fraction of the (s_q x s_k) matrix it
    computes (cost_models.compute.causal_density)."""
    causal = isinstance(n.kwargs, dict) and bool(n.kwargs.get("is_causal"))
    causal = causal or (causal_model and dims[0] == dims[1])
    if not causal:
        return ATTENTION, 1.0
    return ATTENTION_CAUSAL, causal_density(dims[0], dims[1], span)


FLOAT8_KEPT_ROLES = ("lm_head", "moe.router")
PLAIN_LINEAR = f"{nn.Linear.__module__}.{nn.Linear.__qualname__}"   # ModuleInfo.type of an exact nn.Linear


def float8_capable(fqn: str, modules: dict | None) -> bool:
    """Whether the module at ``fqn`` is one the runtime may swap for a float8 Linear: a plain
    ``nn.Linear`` (torchao converts nothing else), not the output head or an MoE router, not inside
    an experts container (experts run torch's grouped GEMM in high precision) --
    ``autoplan.precision.eligible`` keeps the same modules, on the module tree, with reasons."""
    info = modules.get(fqn) if modules else None
    if info is None or info.type != PLAIN_LINEAR or info.role in FLOAT8_KEPT_ROLES:
        return False
    parts = fqn.split(".")
    return not any((modules.get(".".join(parts[:i])) is not None and modules[".".join(parts[:i])].role == "moe.experts")
                   for i in range(1, len(parts)))


def _op_classes(nodes, causal_model: bool = False, modules: dict | None = None,
                fusion: Fusion = EAGER) -> tuple[tuple, float]:
    """(GEMM entries (flops, M, N, K, split), bytes of the other non-view ops, backward counted as
    twice the forward as for ``Work.bytes``). A weight GEMM's entry ends with whether its forward
    adds a bias in the same op (``addmm``: async TP's pass fuses plain matmuls only) and whether
    its module may run in float8 (``float8_capable``). A fused attention op's split is its attention tag
    (``cost_models.compute.ATTENTION`` / ``ATTENTION_CAUSAL``) followed by the fraction of its
    score matrix it computes (by its module's key span, from ``modules``: FQN -> ModuleInfo),
    priced by ``attention_time``."""
    gemms, other = [], 0.0
    for n in nodes:
        short = n.op.split(".")[1] if n.op.count(".") >= 1 else n.op
        dims = gemm_shape_dims(short, [tuple(t.shape) for t in n.inputs])
        if dims is not None and n.flops_fwd > 0:
            f = float(n.flops_fwd + n.flops_bwd)
            if is_attention_op(short):
                info = modules.get(n.module) if modules else None
                gemms.append((f, *dims, *_attention_tag(n, dims, causal_model, info.key_span if info else ())))
            else:   # a weight GEMM also says whether its forward adds a bias in the same op, and
                # whether its module could train in float8
                split = gemm_split(*dims, bool(n.params))
                biased = short in ("addmm", "baddbmm") or (short == "linear" and len(n.inputs) > 2)
                gemms.append((f, *dims, split, biased, float8_capable(n.module, modules))
                             if split else (f, *dims, split))
        elif fusion.fused(n.name):   # a compiled chain's op: its share of the chain's traffic
            other += 3.0 * fusion.bytes[n.name]
        elif not moves_nothing(n):   # every op the capture gives bytes: index_select, _to_copy, cat too
            other += 3.0 * float(n.bytes_read + n.bytes_written)
    return tuple(gemms), other
