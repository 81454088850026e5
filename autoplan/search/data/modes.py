"""Data-parallel mode, recomputation and mixed precision: the exact collectives and per-rank state
bytes the runtime has in each.

``autoplan()`` solves the tensor-parallel styles under FSDP or replicated dp and no or full
recomputation; the whole-cluster search also prices ZeRO-1 and selective recomputation
(``CostContext.dp_mode`` / ``recompute``). What each mode issues and holds, the way the runners
apply it (``autoplan.plan.runner``, ``pipeline_runner``), is stated here and written into the plan
by ``autoplan.assembler`` (``with_dp_mode``, ``with_recompute``, ``with_accumulation``,
``with_mixed_precision``), so ``verify``'s dry run can hold the plan to it byte for byte:

- ``zero1``: the runner's :class:`~autoplan.parallelisms.data.Zero1` reduce-scatters one flat
  fp32 gradient buffer (this rank's TP-local parameters in registration order, padded to a
  multiple of dp) and all-gathers the updated parameters in their dtype: two rows of the padded
  size; optimizer state and fp32 master weights sharded over dp.
- ``selective``: the attention module of every repeated block recomputes its own ops
  (``autoplan.parallelisms.recompute``); no collective is repeated.
- gradient accumulation (one stage, ``pipeline.microbatches = m > 1``): the runner's
  ``forward_backward`` repeats every forward and backward collective (TP, cp, ep, FSDP2's
  gathers and reduce-scatters) once per micro-batch; what ``Runner.data_parallel_step`` issues
  after the last one (replicated dp's all-reduce, ZeRO-1's pair, the all-reduce of parameters
  left out of FSDP, expert parallel's gradient sync) stays once per step.
- mixed precision (FSDP plans with 16-bit compute): ``fsdp.mixed_precision`` is FSDP2's policy,
  bf16 parameters for compute and fp32 gradient reduction. The sharded parameters are then the
  fp32 master weights the optimizer updates (4 bytes each), gradients are reduce-scattered in
  fp32 (4 bytes), all-gathers stay 16-bit; the per-element state total is unchanged
  (4 + 4 + 8 = 2 + 2 + 12 bytes).
"""
from __future__ import annotations

from typing import Sequence

from autoplan.capture.ir import ModelGraph
from autoplan.search.pricing.sharding import param_shards
from autoplan.search.units.structure import ModelStructure
from hyper_parallel.core.collective import Collective

MIXED_PRECISION = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
REDUCE_BYTES = 4   # gradients are reduced in fp32 under mixed precision (FSDP2 policy, ZeRO-1)


def attention_patterns(structure: ModelStructure) -> list[str]:
    """Module patterns of the attention of every repeated block (``layers.*.attention``)."""
    return [f"{b.prefix}.*.{b.attention.rel}" for b in structure.blocks if b.attention is not None]


def zero1_rows(graph: ModelGraph, styles: dict, tp: int, block_prefixes: list[str], dp: int, dp_dim: str,
               units: list[str] | None = None, also: Sequence[str] = ()) -> tuple[list[dict], int]:
    """(the two ZeRO-1 collectives of one step, parameter elements on this rank) for the
    parameters of ``units`` (module FQN prefixes; None: all) and those named in ``also`` (a tied
    parameter's copy a later stage holds, counted under its first name)."""
    shards = param_shards(graph, styles, tp, block_prefixes)
    if units is not None:
        shards = [s for s in shards if s.fqn in also or any(s.fqn.startswith(u + ".") for u in units)]
    n = sum(s.fsdp_local_numel(1) for s in shards)
    padded = -(-n // dp) * dp
    element_bytes = shards[0].dtype_bytes if shards else 4
    rows = [Collective("reduce_scatter", "backward", padded * REDUCE_BYTES, dim=dp_dim).to_row(),
            Collective("all_gather", "backward", padded * element_bytes, dim=dp_dim).to_row()]
    return rows, n
