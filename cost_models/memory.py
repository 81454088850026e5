"""Per-rank memory: parameters, gradients, optimizer state, activations of in-flight micro-batches.

Everything is a function of per-parameter shapes (with the tensor dim TP shards) and per-layer
saved activations (:mod:`cost_models.activations`), plus degrees: tp, fsdp, pipeline stage and
schedule. Shards follow torch.chunk (what DTensor ``Shard`` and FSDP2 use): ceil-sized chunks, the
last ranks possibly smaller or empty; FSDP2 pads dim 0 to a multiple of the fsdp degree.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

import pandas as pd

from hyper_parallel.core.pipeline_parallel import schedule_facts


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter element of each kind of state.

    ``param``/``grad``: the stored (sharded) parameter and its gradient; ``master``: an fp32 copy the
    optimizer keeps when ``param`` is 16-bit (0 otherwise); ``state`` x ``n_states``: AdamW moments;
    ``step_bytes``: AdamW's per-tensor step counter; ``compute_param``: the unsharded 16-bit copy
    FSDP gathers for compute (transient, per layer).
    """

    param: int = 4
    grad: int = 4
    master: int = 0
    state: int = 4
    n_states: int = 2
    step_bytes: int = 4
    compute_param: int = 4


PRECISIONS: dict[str, PrecisionPolicy] = {
    # plain fp32 training, torch.optim.AdamW
    "fp32": PrecisionPolicy(),
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) as in torchtitan: fp32 sharded
    # params/grads/moments, bf16 gathered copy for compute
    "fsdp2_bf16": PrecisionPolicy(param=4, grad=4, master=0, compute_param=2),
    # Megatron mixed precision: bf16 params, fp32 main grads, fp32 master + moments (18 B/param)
    "megatron_bf16": PrecisionPolicy(param=2, grad=4, master=4, compute_param=2),
    # ZeRO paper accounting: fp16 params and grads, fp32 master + moments (16 B/param)
    "zero_fp16": PrecisionPolicy(param=2, grad=2, master=4, compute_param=2),
}


def chunk_size(dim: int, parts: int, rank: int | None = None) -> int:
    """Length of ``rank``'s chunk when ``dim`` is split like torch.chunk into ``parts`` (max if rank is None)."""
    if parts < 1:
        raise ValueError(f"chunk_size: parts={parts} must be >= 1")
    step = math.ceil(dim / parts)
    if rank is None:
        return min(step, dim)
    if not 0 <= rank < parts:
        raise ValueError(f"chunk_size: rank={rank} outside [0, {parts})")
    return max(0, min(step, dim - rank * step))


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its full shape and the tensor dim tensor parallelism shards (None: replicated)."""

    fqn: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    grad_replicated: bool = False  # gradient materialised unsharded over tp (see param_specs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int = 1, tp_rank: int | None = None) -> tuple[int, ...]:
        if self.tp_dim is None or tp == 1:
            return self.shape
        d = self.tp_dim % len(self.shape)
        return tuple(chunk_size(n, tp, tp_rank) if i == d else n for i, n in enumerate(self.shape))

    def local_numel(self, tp: int = 1, fsdp: int = 1, tp_rank: int | None = None,
                    fsdp_rank: int | None = None, fsdp_padded: bool = True) -> int:
        """Elements this rank stores. FSDP shards dim 0 of the TP-local shape (padded, as FSDP2 allocates)."""
        shape = self.local_shape(tp, tp_rank)
        if fsdp == 1 or not shape:
            return math.prod(shape)
        rows = math.ceil(shape[0] / fsdp) if fsdp_padded else chunk_size(shape[0], fsdp, fsdp_rank)
        return rows * math.prod(shape[1:])


# TP style name -> {module kind -> {param name -> sharded dim}}; torch's Colwise/Rowwise conventions
_STYLE_DIMS: dict[str, dict[str, dict[str, int]]] = {
    "colwise": {"linear": {"weight": 0, "bias": 0}, "embedding": {"weight": 1}},
    "rowwise": {"linear": {"weight": 1}, "embedding": {"weight": 0}},
}
_STYLE_ALIASES = {"colwiseparallel": "colwise", "rowwiseparallel": "rowwise", "colwise_rep": "colwise",
                  "colwise_gather_output": "colwise", "rowwise_split_input": "rowwise",
                  "embedding_rowwise": "rowwise", "embedding_colwise": "colwise"}


def tp_shard_dim(style: str, module_kind: str, param_name: str) -> int | None:
    """The dim of ``param_name`` that ``style`` shards on a ``linear``/``embedding`` module (None: replicated).

    Row-wise linears keep their bias replicated; norms, sequence-parallel and unknown styles replicate.
    """
    key = style.lower()
    key = _STYLE_ALIASES.get(key, key)
    return _STYLE_DIMS.get(key, {}).get(module_kind, {}).get(param_name)


def param_specs(model, tp_plan: Mapping[str, str] | None = None,
                runtime: Literal["dtensor", "megatron"] = "dtensor") -> list[ParamSpec]:
    """ParamSpecs of a module (real or meta) under a TP plan {fnmatch pattern of module FQN: style name}.

    Tied parameters are counted once (first name), like ``named_parameters``. Measured on torch
    2.13: DTensor's backward of a vocabulary-sharded (row-wise) embedding yields a *replicated*
    full-size gradient, so with ``runtime="dtensor"`` that gradient is not divided by tp
    (Megatron's VocabParallelEmbedding keeps it sharded).
    """
    import torch.nn as nn

    plan = dict(tp_plan or {})
    specs = []
    seen = set()
    for mod_name, mod in model.named_modules():
        kind = "linear" if isinstance(mod, nn.Linear) else "embedding" if isinstance(mod, nn.Embedding) else "other"
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(mod_name, pat)), None)
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            dim = tp_shard_dim(style, kind, pname) if style else None
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            full_grad = runtime == "dtensor" and kind == "embedding" and dim == 0
            specs.append(ParamSpec(fqn, tuple(p.shape), dim, grad_replicated=full_grad))
    return specs


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(params: Iterable[ParamSpec], tp: int = 1, fsdp: int = 1,
                      precision: PrecisionPolicy | str = "fp32", tp_rank: int | None = None,
                      fsdp_rank: int | None = None, optimizer: Literal["adamw", "sgd", "none"] = "adamw",
                      fsdp_padded: bool = True) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes one rank holds (``tp_rank``/``fsdp_rank`` None: the largest shard).

    ``fsdp_padded``: count parameter storage as FSDP2 allocates it (padded chunks).
    """
    pol = PRECISIONS[precision] if isinstance(precision, str) else precision
    n_states = {"adamw": pol.n_states, "sgd": 0, "none": 0}.get(optimizer)
    if n_states is None:
        raise ValueError(f"model_state_bytes: optimizer={optimizer!r} not in adamw/sgd/none")
    # Measured with FSDP2 on torch 2.13: the sharded parameter's storage is padded (dim 0 to a
    # multiple of the fsdp degree) while gradients and AdamW moments are exactly the local chunk.
    elems = exact = grad_elems = tensors = 0
    for p in params:
        local = p.local_numel(tp, fsdp, tp_rank, fsdp_rank, fsdp_padded)
        chunk = p.local_numel(tp, fsdp, tp_rank, fsdp_rank, fsdp_padded=False)
        elems += local
        exact += chunk
        grad_elems += p.local_numel(1, fsdp, None, fsdp_rank, fsdp_padded=False) if p.grad_replicated else chunk
        tensors += 1
    opt = exact * (pol.master + n_states * pol.state) + (tensors * pol.step_bytes if optimizer == "adamw" else 0)
    return ModelStateBytes(params=elems * pol.param, grads=grad_elems * pol.grad, optimizer=opt)


def inflight_microbatches(schedule: str, pp: int, n_microbatches: int, stage: int = 0,
                          virtual: int = 1) -> float:
    """Micro-batches' worth of one pipeline rank's activations alive at its peak.

    ``schedule`` is a runtime schedule name (``hyper_parallel``'s ``SCHEDULE_NAMES``, as plans store
    them); the count is the runtime's own (``schedule_facts``: the generator's order played), not a
    formula kept here. For reference: GPipe keeps all m; 1F1B pp - stage (at most m); interleaved
    1F1B about (pp - stage)(1 + (pp-1)/(pp v)) (Korthikanti et al.); ZBV pp; this runtime's ZB-H1
    (``ZeroBubble``) defers every dw to the drain, so it holds m until its W runs.
    ``stage`` is the pipeline rank (the stage index with one stage per rank).
    """
    for name, v in (("pp", pp), ("n_microbatches", n_microbatches), ("virtual", virtual)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"inflight_microbatches: {name}={v!r} must be an int >= 1")
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"inflight_microbatches: stage={stage!r} outside [0, {pp})")
    return float(schedule_facts(schedule).inflight_microbatches(pp, n_microbatches, stage, virtual))


def rank_memory(params: Iterable[ParamSpec], layer_activation_bytes: float, n_layers: int, *,
                tp: int = 1, fsdp: int = 1, precision: PrecisionPolicy | str = "fp32", inflight: int = 1,
                largest_layer_params: float = 0.0, fsdp_prefetch: int = 1) -> pd.Series:
    """Peak-memory breakdown of one rank (bytes) as a pandas Series.

    ``params`` are the parameters this pipeline stage owns; ``layer_activation_bytes`` is one
    layer's per-rank bytes for one micro-batch (from :func:`cost_models.activations.activation_bytes`,
    already under the TP/SP layout and checkpointing); ``n_layers`` the layers on this rank;
    ``inflight`` the micro-batches whose activations the rank holds at its peak -- what its
    pipeline schedule says (:func:`inflight_microbatches`), 1 without a pipeline.
    With fsdp > 1 the unsharded compute copy of the largest layer (``largest_layer_params`` elements,
    TP-local) is added once plus ``fsdp_prefetch`` more for the next layer's all-gather.
    """
    pol = PRECISIONS[precision] if isinstance(precision, str) else precision
    states = model_state_bytes(params, tp=tp, fsdp=fsdp, precision=pol)
    acts = layer_activation_bytes * n_layers * inflight
    gathered = largest_layer_params * pol.compute_param * (1 + fsdp_prefetch) if fsdp > 1 else 0.0
    out = pd.Series({"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                     "activations": acts, "fsdp_gathered": gathered, "inflight_microbatches": inflight})
    out["total"] = out[["params", "grads", "optimizer", "activations", "fsdp_gathered"]].sum()
    return out
