"""What a mixture-of-experts plan holds in device memory, term by term, as the runtime holds it.

Why a module of its own: the per-unit memory of a plan (``pipeline.search.UnitCost.state_bytes`` /
``act_bytes``) is written by the TP search (captured saved tensors, ``CostContext.state_bytes``)
and corrected for ep by ``mesh.dims.add_ep`` (expert state / ep, non-expert state over dp x ep
where the runtime shards it); this module holds what is only about memory:

- **Saved activations of hyper_parallel's runtime under ep.** It runs the model's own transformers
  modules, so what it saves is what capture measured -- except the experts: ExpertParallel replaces
  the model's expert forward by its grouped path (``expert_parallel.layouts.stacked_experts`` with the
  module's own gate, then the routing-weighted combine), which keeps one ``rows x hidden`` tensor
  more (the routed outputs it weights). :func:`routed_row_bytes` measures that forward's saved
  storages per routed copy on meta tensors of the layer's widths (GPT-OSS-120B: 57.6 KB per copy
  against 51.9 KB captured, +11 %); the cluster search and the fixed-mesh planner count it.
- **Saved activations of a runtime with fused kernels** (``ExpertRuntime.fused_saves``: Transformer
  Engine / Megatron-Core / NeMo AutoModel's GroupedExperts), counted from the shapes: an RMSNorm
  keeps its input and output and a fp32 1/rms (not HF's fp32 upcast chain, about 8 bytes per
  element), attention q / k / v / output / log-sum-exp (no GQA expansion), the expert MLP its
  dispatched rows, fc1's and the activation's outputs (:func:`norm_saved_bytes`,
  :func:`attention_saved_bytes`, :func:`expert_saved_bytes`).
- **Module recomputation a run states** (``ExpertRuntime.recompute_modules``, Megatron-Core's
  ``recompute_modules``): ``layernorm`` drops each norm's output (recomputed from its input),
  ``moe_act`` the expert activation's output (recomputed from fc1's), ``mla_up_proj`` MLA's q / k /
  v (recomputed from the latents, DeepSeek-V3 sec. 3.2.3). Memory only: this recompute is not
  priced in time.
- **Low-precision activation caching** (``ExpertRuntime.fp8_cache``, DeepSeek-V3 sec. 3.3.2): the
  expert GEMM inputs kept for backward in FP8 (1 byte), the attention output in E5M6 (1.5 bytes).

The per-term breakdown of a priced candidate (params, grads, optimizer, activations, buffers) is
:func:`memory_breakdown`; ``benchmarks/moe_published_runs.py`` writes it for every published run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from autoplan.search.pipeline import schedule_store
from autoplan.search.pipeline.search import stage_bounds
from autoplan.search.units.targets import owner_units
from cost_models.saved_bytes import saved_storage_bytes
from hyper_parallel.core.expert_parallel import ExpertParallel

RSTD_BYTES = 4   # one fp32 1/rms per row (TE's RMSNorm saves it beside its input)


def expert_saved_bytes(tokens: int, top_k: int, hidden: int, ffn: int, dtype_bytes: int, *,
                       recompute_act: bool = False, cached_bytes: float | None = None) -> float:
    """Bytes one MoE layer's grouped expert MLP saves for backward under a fused runtime, one
    micro-batch of ``tokens`` tokens on one rank (balanced routing: a rank receives as many routed
    rows as it sends, ``tokens x top_k``), ``ffn`` = this rank's expert width (F / expert tp):

    - the dispatched rows, ``rows x hidden`` (fc1's weight gradient reads them);
    - fc1's output, ``rows x 2 ffn`` (the gated activation's backward);
    - the activation's output, ``rows x ffn`` (fc2's weight gradient) -- recomputed from fc1's
      output under ``recompute_act`` (Megatron-Core's ``moe_act``);
    - the routing weights (fp32) and expert indices (int64) of every routed copy.

    ``cached_bytes``: bytes per element of the GEMM inputs kept for backward when the run caches
    them in low precision (DeepSeek-V3's FP8: the dispatched rows and the SwiGLU input, 1 byte).

    The routing weight multiplies the activation, between fc1 and fc2 (Megatron-Core's
    ``weighted_bias_swiglu``; NeMo AutoModel's GroupedExpertsDeepEP: "routing weight applied
    BETWEEN up and down projections"), so the combine is an unweighted sum and fc2's output is not
    kept. (hyper_parallel's ExpertParallel weights the output, and keeps it: :func:`routed_row_bytes`.)"""
    rows = tokens * top_k
    act = 0 if recompute_act else ffn
    kept = dtype_bytes if cached_bytes is None else cached_bytes
    return float(rows * (hidden + 2 * ffn + act) * kept + rows * (4 + 8))


def norm_saved_bytes(tokens: int, hidden: int, norms: int, dtype_bytes: int, *, recompute: bool = False) -> float:
    """Bytes ``norms`` fused RMSNorms of one layer save: each its input (the residual stream) and
    one fp32 1/rms per row, and its output (the next projection's input) unless Megatron-Core's
    ``layernorm`` recompute recomputes it."""
    per = hidden * dtype_bytes * (1 if recompute else 2) + RSTD_BYTES
    return float(norms * tokens * per)


def attention_saved_bytes(rows: dict, rep: str, att, tokens: int, dtype_bytes: int, *,
                          recompute_up: bool = False, out_bytes: float | None = None) -> float | None:
    """Bytes a fused attention (TE / FlashAttention / FlexAttention with fused RoPE) saves for one
    layer: q, k, v as projected (RoPE applied in place of a copy; k/v at their own head count, no
    GQA expansion), the attention output (o's input) and the fp32 log-sum-exp per head and token.
    ``recompute_up`` (DeepSeek-V3's "recompute MLA up-projections"): a projection that widens a
    latent (its input narrower than its output) keeps its input and recomputes q / k / v from it.
    ``out_bytes``: bytes per element the attention output is cached in (DeepSeek-V3: E5M6, 1.5).
    None when the captured projections' shapes are not known (a fused q/k/v projection)."""
    if not (att.q and att.k and att.v and att.o):
        return None

    def numel(fqn: str, key: str) -> int | None:
        shapes = rows.get(f"{rep}.{fqn}", {}).get(key) or []
        if not shapes:
            return None
        n = 1
        for d in shapes[0]:
            n *= int(d)
        return n

    projs = list(dict.fromkeys((att.q, att.k, att.v)))   # k == v: one kv projection (MLA's kv_b_proj)
    outs = [numel(x, "output_shapes") for x in projs]
    ins = [numel(x, "input_shapes") for x in projs]
    o_in = numel(att.o, "input_shapes")
    if any(x is None for x in outs + ins) or o_in is None:
        return None
    kept = [i if recompute_up and i < o else o for i, o in zip(ins, outs)]
    o_bytes = dtype_bytes if out_bytes is None else out_bytes
    return float(sum(kept) * dtype_bytes + o_in * o_bytes + tokens * att.n_heads * 4)


def routed_row_bytes(module, layout, top_k: int, dtype: torch.dtype) -> float:
    """Bytes hyper_parallel's ExpertParallel forward keeps for backward per routed copy (token x
    top_k) of one MoE layer in compute ``dtype``, measured: the style's own forward
    (``ExpertParallel._forward``: the grouped path ``stacked_experts`` with the module's own gate,
    the routing-weighted combine) run once on a meta copy of the module in ``dtype`` with meta
    inputs of the layer's real widths, autograd's saved storages counted (``cost_models.saved_bytes``;
    parameters and the inputs excluded), divided by the routed rows. Every saved tensor has a row
    per routed copy or per token, so the count scales with the rows."""
    # by class, not instance: the count depends on the module's code and widths, and a cache must
    # not keep a model alive
    key = (type(module), layout, top_k, dtype)
    if key not in _ROW_BYTES:
        _ROW_BYTES[key] = _routed_row_bytes(_meta_copy(module, dtype), layout, top_k, dtype)
    return _ROW_BYTES[key]


_ROW_BYTES: dict[tuple, float] = {}


def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` on meta, its floating tensors in ``dtype``, without copying any weight (deepcopy's
    memo maps every parameter and buffer to a meta tensor of its shape)."""
    def meta(t):
        out = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out
    memo = {id(t): meta(t) for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _routed_row_bytes(module, layout, top_k: int, dtype) -> float:
    tokens = max(layout.num_experts, 8)
    hidden = torch.empty(tokens, layout.hidden, dtype=dtype, device="meta", requires_grad=True)
    weights = torch.empty(tokens, top_k, dtype=dtype, device="meta", requires_grad=True)
    index = torch.zeros(tokens, top_k, dtype=torch.long, device="meta")
    style = ExpertParallel(ep_dim="", balanced=True)   # balanced: meta tensors carry no routing
    nbytes, _ = saved_storage_bytes(
        lambda: style._forward(module, layout, hidden, index, weights, 1, 0, 0, None, None),
        exclude=[hidden, weights, *module.parameters()])
    return nbytes / (tokens * top_k)


def expert_saved_delta(group, model, tokens: int, dtype: torch.dtype) -> float:
    """Bytes one micro-batch of ``tokens`` tokens per rank saves in ``group``'s MoE layers (all of
    them) under ExpertParallel beyond what capture counted for the model's own expert forward."""
    prefix = f"{group.block_prefix}.{group.indices[0]}" if group.block_prefix else str(group.indices[0])
    per_row = routed_row_bytes(model.get_submodule(f"{prefix}.{group.rel}"), group.layout, group.top_k, dtype)
    return (per_row * tokens * group.top_k - group.work.saved) * group.count


def ep_groups(experts) -> list:
    """The MoE groups an ``experts.planning.ExpertPlanning`` put under ExpertParallel without expert TP
    (whose forward :func:`routed_row_bytes` measures)."""
    return [g for g, o in zip(experts.choice.groups, experts.choice.chosen)
            if o.style is not None and o.style.tp_dim is None]


def planned_saved_delta(experts, model, dtype: torch.dtype, checkpoint_blocks: bool) -> float:
    """Activation bytes per micro-batch the ExpertParallel styles of ``experts`` (an
    ExpertPlanning) save beyond the captured expert forwards the TP search counted; 0 under full
    recomputation of the blocks (the plan's, ``checkpoint_blocks``: a block then keeps only its
    input). What the fixed-mesh planner adds."""
    if checkpoint_blocks:
        return 0.0
    return sum(expert_saved_delta(g, model, experts.tokens, dtype) for g in ep_groups(experts))


def restate_our_experts(acc: list[list[float]], names: Sequence[str], experts, ctx, meta_model, *, tokens: int,
                        dtype: torch.dtype) -> None:
    """hyper_parallel's runtime under ep (row 4 of ``acc``): each MoE layer's experts save what
    :func:`routed_row_bytes` measures of the ExpertParallel forward, not what capture measured of the
    model's own expert forward (which ExpertParallel replaces; it keeps one more ``rows x hidden``
    tensor, the routed outputs it weights). Nothing under full recomputation (``ctx``'s)."""
    if ctx.checkpoint_blocks:
        return
    index = {n: i for i, n in enumerate(names)}
    for g in ep_groups(experts):
        units = _group_units(g, index)
        for i in units:
            acc[i][4] = max(acc[i][4] + expert_saved_delta(g, meta_model, tokens, dtype) / len(units), 0.0)


def _group_units(g, index: dict) -> list[int]:
    owner = g.pattern[: -len(g.rel) - 1]
    return [index[u] for u in owner_units(owner, g.block_prefix, g.indices) if u in index]


def restate_activations(acc: list[list[float]], names: Sequence[str], structure, groups: Sequence, ctx, runtime, *,
                        tokens: int, rows: dict | None = None) -> None:
    """Replace, in the per-unit rows ``acc`` (row 4: saved activation bytes per micro-batch), what
    capture measured for the residual norms and the expert MLPs by what ``runtime`` saves when it
    runs fused kernels (module docstring), and with ``rows`` (``module_summary`` rows by FQN) the
    attention's (:func:`attention_saved_bytes`). Nothing changes for hyper_parallel's runtime, nor
    under full recomputation (a block then keeps only its input), nor with a tensor-parallel
    dimension (the published runs priced with a fused runtime have tp = 1; the per-rank shares of a
    sequence-parallel stream are not restated)."""
    tp = ctx.topology[ctx.tp_dim].size if ctx.tp_dim in ctx.topology.names else 1
    if not getattr(runtime, "fused_saves", False) or ctx.checkpoint_blocks or tp > 1:
        return
    recompute = set(getattr(runtime, "recompute_modules", ()))
    fp8 = getattr(runtime, "fp8_cache", False)
    index = {n: i for i, n in enumerate(names)}
    dtype = structure.dtype_bytes
    for b in structure.blocks:
        units = _units(index, b.prefix, b.indices)
        if not units:
            continue
        delta = 0.0
        if b.norms:
            fused = norm_saved_bytes(tokens, b.dim, len(b.norms), dtype, recompute="layernorm" in recompute)
            delta += fused - b.norm_work.saved
        att = b.attention
        if att is not None and rows is not None:
            fused = attention_saved_bytes(rows, b.representative, att, tokens, dtype,
                                          recompute_up="mla_up_proj" in recompute,
                                          out_bytes=1.5 if fp8 else None)
            captured = att.work.saved
            if ctx.recompute == "selective" and att.work.core is not None:   # the core is recomputed
                captured = max(captured - att.work.core.saved, 0.0)
                fused = None
            if fused is not None:
                delta += fused - captured
        delta *= b.count / len(units)
        for i in units:
            acc[i][4] = max(acc[i][4] + delta, 0.0)
    for g in groups:
        units = _group_units(g, index)
        if not units:
            continue
        fused = expert_saved_bytes(tokens, g.top_k, g.layout.hidden, g.layout.ffn, dtype,
                                   recompute_act="moe_act" in recompute, cached_bytes=1 if fp8 else None)
        delta = (fused - g.work.saved) * g.count / len(units)
        for i in units:
            acc[i][4] = max(acc[i][4] + delta, 0.0)


def _units(index: dict, prefix: str, indices: Sequence[str]) -> list[int]:
    return [index[u] for u in (f"{prefix}.{i}" if prefix else str(i) for i in indices) if u in index]


@dataclass
class MemoryBreakdown:
    """Bytes on the busiest pipeline rank by term: parameters, gradients, optimizer state (after
    TP, ep, FSDP / ZeRO-1 and the runtime's dp x ep sharding), saved activations of the
    micro-batches it holds in flight, and buffers (the largest FSDP-gathered unit it holds
    unsharded for compute, approximately: the unit's parameter share x (dp - 1); 0 without FSDP
    over dp -- reported beside the plan's memory, which does not count it)."""

    rank: int
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    inflight: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def terms(self) -> dict[str, float]:
        """The bytes a plan's ``predictions.memory_bytes`` holds (buffers are reported beside it)."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations}

    def gib(self) -> dict[str, float]:
        g = 2.0 ** 30
        return {"mem_params_gib": self.params / g, "mem_grads_gib": self.grads / g,
                "mem_optimizer_gib": self.optimizer / g, "mem_activations_gib": self.activations / g,
                "mem_buffers_gib": self.buffers / g, "mem_total_gib": self.total / g, "mem_inflight": self.inflight}


def memory_breakdown(choice, units: Sequence, ctx) -> MemoryBreakdown:
    """The busiest rank's memory of a timed pipeline ``choice`` (``pipeline.search.time_choice``
    filled ``rank_memory`` / ``peak_inflight``) split by term. A unit's state bytes are split into
    params / grads / optimizer in the proportion ``ctx.state_bytes`` gives one parameter byte (the
    dp mode's sharding of each term); the activations are ``rank_memory`` minus the state, which is
    how ``time_choice`` counts them (in-flight chunks x the mean activation per chunk)."""
    p = choice.p
    s2r = schedule_store.placement(choice.schedule, p, choice.m, choice.v)[0] if p > 1 else [0] * len(choice.starts)
    state = [0.0] * p
    held: list[list] = [[] for _ in range(p)]
    for s, (a, b) in enumerate(stage_bounds(choice.starts, len(units))):
        r = s2r[s]
        state[r] += sum(u.state_bytes for u in units[a:b])
        held[r].extend(units[a:b])
    r = max(range(p), key=lambda k: (choice.rank_memory[k], -k))
    one = ctx.state_bytes(float(ctx.param_bytes_per_element), 1)
    whole = sum(one.values())
    split = {k: v / whole for k, v in one.items()}
    buffers = 0.0
    if ctx.fsdp and ctx.dp > 1 and held[r]:
        # FSDP gathers one unit at a time: its unsharded parameters (bf16) sit beside the shards
        pbytes = max(u.state_bytes * split["params"] for u in held[r])
        buffers = pbytes * (ctx.dp - 1)
    return MemoryBreakdown(r, state[r] * split["params"], state[r] * split["grads"], state[r] * split["optimizer"],
                           max(choice.rank_memory[r] - state[r], 0.0), buffers,
                           choice.peak_inflight[r] if choice.peak_inflight else 1)
