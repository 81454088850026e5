"""Planning expert parallelism on a fixed mesh: per MoE block group, ExpertParallel against
replicated experts, priced with the cost model.

Integration chosen (the smallest clean one): the expert choice is made per MoE block group
*beside* the tensor-parallel ILP, not inside it. The ILP keeps planning every dense unit
(attention, dense MLPs, embedding, head) exactly as before -- the MoE layer is no unit of it
(``structure.not_units``), its work stays replicated compute of the block -- and this module
adds what the experts' strategy changes: all-to-all and expert-TP traffic, the expert compute
under expert TP and the routing-imbalance factor, the expert weights' state per rank. Why beside:
an experts container's choice does not change any dense unit's layout (ExpertParallel takes and
returns the replicated token rows its router sees), so the joint optimum is the TP optimum plus
the best expert option; the ILP stays as it is and fast.

Tokens: the mesh's ep dimension shards the batch (ep borrows from dp; the runtime's default
mode), so each rank routes ``T = global_batch / (dp x ep) x seq`` tokens; the captured graph is
one rank's share, so its expert work is already that of T tokens with top-k routed rows (the
grouped GEMMs' FLOPs). Candidates per group, on mesh (.., ep, .., tp):

- ``expert_parallel``: ExpertParallel(ep_dim): E/ep experts per rank; the all-to-alls of
  ``ExpertParallel.predicted_collectives`` priced on the ep dimension's link level (intra- or
  inter-node, cost_models' alpha-beta); expert compute x imbalance; expert state / ep.
- ``expert_parallel_tp`` (with a tp dimension, 3-D weights, F divisible by tp): + expert TP:
  compute / tp, one all-reduce over tp forward and one backward; state / (ep x tp).
- ``replicated``: every expert on every rank; ep is then pure data parallel: the expert
  gradients are all-reduced over ep; state whole.

Routing imbalance: a stated factor (default 1.0, balanced routing) multiplying the expert
compute of the expert-parallel options (the busiest rank sets the step); written in the plan's notes.
What the step time does not see: the ILP's data-parallel cost still counts expert parameters
unsharded (FSDP bytes in the plan's *collectives* and memory are exact, from the sharded shapes).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

from autoplan.capture.ir import ModelGraph
from autoplan.capture.views import module_summary
from autoplan.search.units.work import Work, module_work
from cost_models.compute import grouped_gemm_efficiency
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.expert_parallel import ExpertParallel
from hyper_parallel.core.expert_parallel.layouts import ExpertsLayout, read_layout
from hyper_parallel.errors import HyperParallelError

log = logging.getLogger(__name__)


ROUTINGS = ("independent", "contiguous")


@dataclass(frozen=True)
class ExpertRuntime:
    """What the training runtime does with the experts' all-to-alls -- a fact about the runtime,
    stated (with its source) by whoever prices a run, never fitted.

    hyper_parallel's runtime (the default): every routed copy of a token travels (no per-node
    de-duplication), over the ep dimension's one link level, and the all-to-alls are exposed
    (nothing overlaps them with compute). Other runtimes, as their publications describe them:

    - ``node_limit``: each token is routed to experts on at most this many nodes and sent once
      per destination node (DeepSeek-V3's node-limited routing, M = 4, with DeepEP's dispatch:
      one copy over InfiniBand per node, forwarded over NVLink inside it; tech report sec. 2.1.2
      and 3.2.2). 0: off.
    - ``dedup``: one copy per destination node without a routing limit (DeepEP's dispatch / combine
      kernels: each token crosses InfiniBand once per node holding one of its experts, NVLink forwards
      it; deepseek-ai/DeepEP README, "normal kernels ... NVLink to RDMA asymmetric-domain forwarding").
    - ``dense_state_over_ep``: the state of the parameters outside the experts is sharded over dp x ep
      with replicated dp too. Under FSDP and ZeRO-1 every runtime priced shards it there, at dp = 1
      too -- ours (FSDP2 over the flattened dp x ep mesh, ``parallelisms.data.state_mesh``; ZeRO-1's
      flat buffer over it, ``data.zero1_of``), Megatron-Core's distributed optimizer over the whole
      data-parallel group, AutoModel's FSDP2 over dp_shard x ep at dp_shard 1; with replicated dp
      ours replicates it over ep and all-reduces its gradients there.
    - ``overlap``: the fraction of the all-to-alls hidden behind the other micro-batch's compute
      (DualPipe's forward/backward chunk pairs, tech report sec. 3.2.1; Megatron-Core's EP A2A
      overlap of two micro-batches): at most the layer's own compute can hide them. 0: none.
    - ``routing``: where a token's top_k experts lie, which sets how many ranks and nodes a
      de-duplicating dispatch (``dedup`` / ``node_limit``) sends it to. ``"independent"``: each of
      the top_k an independent uniform pick (a learned router under balanced load, Megatron-Core's
      ``moe_router_force_load_balancing`` random logits); ``"contiguous"``: k consecutive experts
      starting at a multiple of k (NeMo AutoModel's ``FakeBalancedGate``, which its performance
      summary runs: token t -> experts (t * k + j) mod E, j < k; nemo_automodel/components/moe/
      layers.py), so a token's copies land on one or two ranks of one node.
    - ``fused_saves``: its norms and expert MLPs are fused kernels (Transformer Engine, Megatron-Core's
      / AutoModel's grouped experts) that save fewer activations than the transformers modules ours
      runs (``moe_memory``). Memory only.
    - ``recompute_modules``: the modules whose outputs the run recomputes instead of saving, as
      Megatron-Core's ``recompute_modules`` names them (``layernorm``, ``moe_act``; ``mla_up_proj``:
      DeepSeek-V3's MLA up-projections). Memory only.
    - ``fp8_cache``: activations kept for backward in low precision (DeepSeek-V3 sec. 3.3.2). Memory only.
    - ``regroup``: with ep > 1 the received rows are re-sorted by local expert after the dispatch
      all-to-all and back into source order before the combine's -- one more read and write of
      the routed rows each way (hyper_parallel's ``dispatch``: ``received[regroup]`` and
      ``expert_out[ungroup]``; Megatron-Core's alltoall dispatcher: ``sort_chunks_by_idxs`` both
      ways). DeepEP's dispatch hands the rows over per token and one permute groups them: False.
    - ``weights_apart``: the routing weights scale the returned rows in a pass of their own before
      they are summed per token (hyper_parallel's ``combine``: ``back * weights``, then
      ``index_add``); Transformer Engine's fused unpermute (Megatron-Core's ``moe_permute_fusion``,
      AutoModel) folds them into the sum: False.
    - ``bias_passes``: for experts with biases (GPT-OSS), the HBM passes over the gate/up output
      (rows x 2F / etp) and over the down output (rows x H) that adding them takes, forward and
      backward. Ours, 5 each (``layouts.stacked_experts``: ``h + bias[expert_of_row]`` -- the
      gathered bias written, both read, the sum written; the bias gradient's scatter reads the
      gradient once). Megatron-Core's TEGroupedMLP fuses the gate/up bias into its weighted
      activation (0) and adds the down bias scaled by the routing weights per expert (``_apply_bias``:
      split, ``t + b * p``, concatenate -- 6 passes forward, 6 backward); AutoModel's DeepEP experts add
      both that way (5, 12: ``DEEPEP_RUNTIME``).
    """

    node_limit: int = 0
    overlap: float = 0.0
    dedup: bool = False
    dense_state_over_ep: bool = False
    routing: str = "independent"
    source: str = "hyper_parallel's runtime: all-to-alls of every routed copy, exposed"
    fused_saves: bool = False
    recompute_modules: tuple = ()
    fp8_cache: bool = False
    regroup: bool = True
    weights_apart: bool = True
    bias_passes: tuple = (5, 5)

    def __post_init__(self) -> None:
        if self.node_limit < 0 or not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"ExpertRuntime: node_limit={self.node_limit} must be >= 0 and overlap={self.overlap} "
                             "in [0, 1]")
        if self.routing not in ROUTINGS:
            raise ValueError(f"ExpertRuntime: routing={self.routing!r} is not one of {ROUTINGS}")

    @property
    def ours(self) -> bool:
        return self == ExpertRuntime(source=self.source)

    def destinations(self, groups: int, top_k: int, experts: int = 0) -> float:
        """Distinct groups (ranks or nodes, each holding an equal contiguous block of the
        ``experts``) one token's ``top_k`` copies reach, on average under this runtime's routing:
        independent picks groups x (1 - (1 - 1/groups)^top_k); contiguous routing counts the
        groups each window of k consecutive experts (starting at t * k mod E) spans."""
        groups = max(int(groups), 1)
        if self.routing == "contiguous" and experts >= groups and top_k >= 1:
            step = math.gcd(top_k, experts)
            spans = [len({((s + j) % experts) * groups // experts for j in range(top_k)})
                     for s in range(0, experts, step)]
            return sum(spans) / len(spans)
        return groups * (1.0 - (1.0 - 1.0 / groups) ** top_k)

    def node_copies(self, nodes: int, top_k: int, experts: int = 0) -> float:
        """Copies of one token that cross the inter-node link when its ``top_k`` experts sit on
        ``nodes`` nodes: top_k without per-node de-duplication; with it (``dedup`` or a node limit)
        the distinct nodes its experts lie on (:meth:`destinations`), at most ``node_limit``."""
        if not (self.dedup or self.node_limit):
            return float(top_k)
        distinct = self.destinations(nodes, top_k, experts)
        return min(distinct, float(self.node_limit)) if self.node_limit else distinct

    def note(self) -> str:
        if self.ours:
            return ("expert all-to-alls priced as hyper_parallel's runtime issues them: every routed copy over the ep "
                    "dimension's link, not overlapped with compute")
        return (f"expert all-to-alls priced for another runtime ({self.source}): "
                + (f"node-limited routing (<= {self.node_limit} nodes per token, one copy per node over the "
                   f"inter-node link); " if self.node_limit else "")
                + ("one copy per destination node (per-node de-duplication); " if self.dedup and not self.node_limit
                   else "")
                + ("non-expert state sharded over dp x ep; " if self.dense_state_over_ep else "")
                + ("each token's top-k experts consecutive (a benchmark's balanced fake gate); "
                   if self.routing == "contiguous" else "")
                + (f"{self.overlap:.0%} overlapped with the other micro-batch's compute; " if self.overlap else "")
                + "hyper_parallel's runtime does neither")

    def a2a_time(self, ctx, collectives: list[Collective], top_k: int, experts: int = 0) -> float:
        """Seconds of the expert all-to-alls ``collectives`` on ``ctx``'s mesh under this runtime
        (before overlap). A de-duplicating runtime (``dedup`` / ``node_limit``: DeepEP's kernels)
        sends a token once per destination rank, not once per routed copy: inside a node the
        dispatch / combine carries (distinct ranks / top_k) of the routed bytes; across nodes it
        sends one copy per destination node over the inter-node link (at most ``node_limit``) and
        forwards one per destination rank over the intra-node link at the same time (DeepEP's
        normal kernels run both concurrently): the slower of the two. ``experts``: the layer's
        expert count (where each rank's block of experts lies, for ``routing``)."""
        t = 0.0
        for c in collectives:
            md = ctx.topology[c.dim] if c.dim in ctx.topology.names else None
            if not ((self.node_limit or self.dedup) and c.kind == "all_to_all" and md is not None):
                t += ctx.collective_time(c)
                continue
            per_rank = self.destinations(md.size, top_k, experts) / max(top_k, 1)
            if not md.inter_node:
                t += ctx.collective_time(dataclasses.replace(c, nbytes=int(c.nbytes * per_rank)))
                continue
            nodes = max(md.size // max(md.rails, 1), 1)
            inter = ctx.collective_time(dataclasses.replace(
                c, nbytes=int(c.nbytes * self.node_copies(nodes, top_k, experts) / max(top_k, 1))))
            hw = ctx.hardware
            intra = c.count * c.nbytes * per_rank / (hw.intra_node.bandwidth * hw.efficiency.link)
            t += max(inter, intra)
        return t

    def exposed(self, a2a_s: float, compute_s: float) -> float:
        """What of ``a2a_s`` stays on the critical path when ``compute_s`` of the other
        micro-batch's compute runs beside it."""
        return a2a_s - min(a2a_s * self.overlap, compute_s)


OUR_EXPERT_RUNTIME = ExpertRuntime()
# DeepSeek-V3's training runtime as its technical report (arXiv 2412.19437) describes it: for
# pricing its published runs ("their runtime, not ours"), never hyper_parallel's plans
DEEPSEEK_V3_RUNTIME = ExpertRuntime(
    node_limit=4, overlap=1.0, dedup=True, dense_state_over_ep=True, regroup=False, weights_apart=False,
    source="DeepSeek-V3 tech report sec. 2.1.2: each token sent to at most M = 4 nodes; sec. 3.2.1-3.2.2: DualPipe "
           "overlaps each chunk's all-to-alls with the other chunk's computation ('both all-to-all and PP "
           "communication can be fully hidden'), dispatch one copy per node over IB, forwarded over NVLink; sec. 3.2: "
           "ZeRO-1 data parallelism (the optimizer over the whole data-parallel group)")
# NeMo AutoModel's MoE recipes as its performance summary runs them: DeepEP dispatch / combine (one
# copy per destination node, no routing limit, not overlapped) and FSDP2 over dp_shard x ep
# Its experts add their biases apart from the GEMMs (GroupedExpertsDeepEP._apply_bias: split per expert, add,
# concatenate): gate/up 4 passes forward + the bias gradient's read; down ``t + b * p`` 6 forward + 6 backward
# (the probability-scaled bias and both its gradients)
DEEPEP_RUNTIME = ExpertRuntime(
    dedup=True, dense_state_over_ep=True, regroup=False, weights_apart=False, bias_passes=(5, 12),
    source="deepseek-ai/DeepEP README: normal dispatch/combine kernels forward each token once per destination "
           "node over RDMA and then over NVLink; NVIDIA-NeMo/Automodel docs/performance-summary.md: TE + DeepEP, "
           "FSDP2 (dp_shard) x EP; nemo_automodel/components/moe/layers.py GroupedExpertsDeepEP._apply_bias "
           "(8d9bfb90e): expert biases added per expert and concatenated")

# the runtimes a caller can name (``constraints={"expert_runtime": name}``); any other is stated as
# an ExpertRuntime with its source
EXPERT_RUNTIMES = {"hyper_parallel": OUR_EXPERT_RUNTIME, "deepep": DEEPEP_RUNTIME, "deepseek_v3": DEEPSEEK_V3_RUNTIME}


def stated_runtime(value) -> ExpertRuntime:
    """The ExpertRuntime a constraint states: one, or a name in ``EXPERT_RUNTIMES``; ValueError otherwise."""
    if isinstance(value, ExpertRuntime):
        return value
    if isinstance(value, str) and value in EXPERT_RUNTIMES:
        return EXPERT_RUNTIMES[value]
    raise ValueError(f"{value!r} is neither an ExpertRuntime nor one of {sorted(EXPERT_RUNTIMES)}")


@dataclass
class MoEGroup:
    """The MoE layer of one block group: its experts container and the shapes that price it."""

    block_prefix: str
    indices: list[str]
    rel: str                    # experts container relative to a block, e.g. "mlp.experts"
    pattern: str                # what the plan styles ("model.layers.*.mlp.experts")
    count: int                  # MoE layers in the group
    layout: ExpertsLayout
    top_k: int
    work: Work                  # the experts container per call (one rank's tokens)
    param_bytes: int            # expert weights of one layer, whole

    @property
    def experts(self) -> int:
        return self.layout.num_experts


@dataclass
class ExpertOption:
    name: str
    style: ExpertParallel | None     # None: replicated experts
    collectives: list[Collective]    # per step, every layer of the group, on mesh dimension names
    compute_s: float                 # expert compute per step (all layers)
    comm_s: float
    state: dict[str, float]          # params / grads / optimizer bytes of the group's experts per rank (all layers)
    reason: str
    excluded: str | None = None      # why it cannot run (then never chosen)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def state_bytes(self) -> float:
        return sum(self.state.values())


@dataclass
class ExpertChoice:
    """The expert decision of a plan: per group the chosen option and every candidate."""

    ep_dim: str
    groups: list[MoEGroup]
    chosen: list[ExpertOption]
    options: list[list[ExpertOption]]
    imbalance: float
    base_compute_s: float            # what the TP search already counts for the experts (replicated, captured work)
    notes: list[str] = field(default_factory=list)

    @property
    def styles(self) -> dict[str, dict]:
        return {g.pattern: o.style.to_dict() for g, o in zip(self.groups, self.chosen) if o.style is not None}

    def collectives(self) -> list[Collective]:
        return [c for o in self.chosen for c in o.collectives]

    @property
    def extra_step_s(self) -> float:
        """Seconds the experts' strategy adds to the TP search's step (which counts their
        compute replicated and no expert traffic)."""
        return sum(o.step_s for o in self.chosen) - self.base_compute_s

    def state_saving(self, replicated_state: float) -> float:
        return replicated_state - sum(o.state_bytes for o in self.chosen)


def _pattern(prefix: str, indices: list[str], siblings: int, rel: str, others_have: bool = True) -> list[str]:
    """One ``*`` pattern when it names exactly this group's experts: the group is all of its
    container's children, or no other child has a module at ``rel`` (DeepSeek-V3's first dense
    layers have no ``mlp.experts``); else one pattern per block."""
    if len(indices) > 1 and (len(indices) == siblings or not others_have):
        return [f"{prefix}.*.{rel}" if prefix else f"*.{rel}"]
    return [f"{prefix}.{i}.{rel}" if prefix else f"{i}.{rel}" for i in indices]


def _others_have(model, prefix: str, indices: list[str], rel: str) -> bool:
    """Some child of ``prefix`` outside ``indices`` has a module at ``rel``."""
    container = model.get_submodule(prefix) if prefix else model
    mine = set(map(str, indices))
    for name, child in container.named_children():
        if name in mine:
            continue
        try:
            child.get_submodule(rel)
            return True
        except AttributeError:
            continue
    return False


def moe_groups(graph: ModelGraph, model, dtype_bytes: int) -> list[MoEGroup]:
    """Every MoE layer the capture recognised (roles ``moe``), one entry per block group (a
    group whose block indices are not all of its container's children gets one entry per block,
    so no pattern names a dense layer). ``dtype_bytes``: the planned parameter dtype's size (the
    model given may hold another dtype, e.g. fp32 on meta for a bf16 plan)."""
    rows = None
    out = []
    for b in graph.blocks:
        for e in (b.roles or {}).get("moe", []):
            if not e.get("experts"):
                continue
            fqn = f"{b.representative}.{e['experts']}"
            try:
                module = model.get_submodule(fqn)
                layout = read_layout(module, fqn)
            except (AttributeError, HyperParallelError) as exc:
                log.info("expert parallel: %s is not an experts container ExpertParallel takes: %s", fqn, exc)
                continue
            siblings = len(list(model.get_submodule(b.prefix).children())) if b.prefix else 1
            pbytes = sum(p.numel() for p in module.parameters()) * dtype_bytes
            if rows is None:
                rows = {r["fqn"]: r for r in module_summary(graph).to_dict("records")}
            work = module_work(graph, fqn, rows)
            others = siblings != len(b.indices) and _others_have(model, b.prefix, list(b.indices), e["experts"])
            for pattern in _pattern(b.prefix, list(b.indices), siblings, e["experts"], others):
                n = b.count if "*" in pattern else 1
                out.append(MoEGroup(b.prefix, list(b.indices), e["experts"], pattern, n, layout,
                                    int(e.get("top_k") or 1), work, pbytes))
    return out


def expert_gemm_shapes(group: MoEGroup, *, tokens: int, ep: int, etp: int) -> list[tuple[float, float, float, int]]:
    """The grouped GEMMs one rank runs for one MoE layer's experts: (M = rows per local expert,
    N, K, local experts) of gate/up (2F / etp outputs, concatenated or two of F) and of down --
    under balanced routing a rank receives ``tokens x top_k`` rows over its E / ep experts."""
    lay = group.layout
    local = max(lay.num_experts // max(ep, 1), 1)
    h, f = lay.hidden, lay.ffn / etp
    m = tokens * group.top_k / local
    return [(m, 2 * f, h, local), (m, h, f, local)]


def grouped_expert_time(ctx, group: MoEGroup, *, tokens: int, dtype_bytes: int, ep: int, etp: int,
                        runtime: ExpertRuntime = OUR_EXPERT_RUNTIME) -> float:
    """Seconds per call of one MoE layer's experts on one rank, from what the hardware runs:

    - the grouped GEMMs (gate/up, then down; :func:`expert_gemm_shapes`) at the achieved efficiency
      of one expert's GEMM shape (``cost_models.compute.grouped_gemm_efficiency``: measured grouped
      GEMMs on a device profile, else one GEMM's curve; M = the rows an expert receives, N / K = hidden and
      the expert's ffn / etp), a roofline against the bytes of the weights this rank holds -- its
      E/ep local experts, not all E;
    - the routing glue at its real HBM traffic: permute (read + write each routed row), the
      activation (read gate/up, write its product), unpermute and the weighted combine (read each
      row, write each token), and the passes ``runtime`` adds (its ``regroup`` of the received rows
      by local expert and back, with ep > 1; its ``weights_apart`` scaling of the returned rows);
      the backward twice the forward; experts with biases add the runtime's ``bias_passes``;
    - the container's kernel launches.
    Balanced routing (the imbalance factor multiplies the result): every rank receives as many
    routed rows as it sends, ``tokens x top_k``."""
    hw, lay = ctx.hardware, group.layout
    peak, bw = hw.peak(ctx.dtype), hw.memory_bandwidth * hw.efficiency.memory
    rows = tokens * group.top_k
    h, f = lay.hidden, lay.ffn / etp
    t = 0.0
    for m, n_out, k_in, local in expert_gemm_shapes(group, tokens=tokens, ep=ep, etp=etp):
        flops = 3 * 2.0 * m * local * n_out * k_in       # forward + backward (input and weight grads)
        weight_bytes = 3 * local * n_out * k_in * dtype_bytes
        t += max(flops / (peak * grouped_gemm_efficiency(hw, m, n_out, k_in)), weight_bytes / bw)
    passes = 2 * (int(runtime.regroup and ep > 1) * 2 + int(runtime.weights_apart))   # row reads + writes
    glue = (2 * rows * h + 3 * rows * f + rows * h + tokens * h + passes * rows * h) * dtype_bytes   # forward
    bias = 0.0
    if lay.biases:   # forward and backward already: the runtime's passes over the two GEMMs' outputs
        gate_up_passes, down_passes = runtime.bias_passes
        bias = (gate_up_passes * rows * 2 * f + down_passes * rows * h) * dtype_bytes
    return t + (3 * glue + bias) / bw + group.work.kernels * hw.efficiency.kernel_overhead


def expert_time(ctx, group: MoEGroup, *, tokens: int, dtype_bytes: int, ep: int, etp: int,
                runtime: ExpertRuntime = OUR_EXPERT_RUNTIME) -> float:
    """:func:`grouped_expert_time` on datasheet profiles; on a calibrated eager host (``ctx.runtime``)
    the captured work as every other op there (measured per-kernel overheads dominate)."""
    if ctx.runtime is not None or getattr(ctx.hardware, "device_type", None) == "cpu":
        return ctx.compute_time(group.work, etp)
    return grouped_expert_time(ctx, group, tokens=tokens, dtype_bytes=dtype_bytes, ep=ep, etp=etp, runtime=runtime)


def expert_options(group: MoEGroup, ctx, *, tokens: int, dtype_bytes: int, ep_name: str, ep: int,
                   tp_name: str | None, tp: int, imbalance: float,
                   runtime: ExpertRuntime = OUR_EXPERT_RUNTIME) -> list[ExpertOption]:
    """The candidates for one group (see the module docstring), priced per step under ``runtime``."""
    n = group.count
    base = expert_time(ctx, group, tokens=tokens, dtype_bytes=dtype_bytes, ep=1, etp=1, runtime=runtime) * n
    out = []
    ar = Collective("all_reduce", "backward", int(group.param_bytes), count=n, dim=ep_name)
    out.append(ExpertOption("replicated", None, [ar], base, ctx.collective_time(ar), ctx.state_bytes(group.param_bytes * n, 1),
                            f"every expert on every rank; their gradients all-reduced over {ep_name}"))
    for etp in ([1, tp] if tp > 1 else [1]):
        name = "expert_parallel" if etp == 1 else "expert_parallel_tp"
        style = ExpertParallel(ep_dim=ep_name, tp_dim=tp_name if etp > 1 else None)
        excluded = None
        if etp > 1 and (group.layout.kind != "stacked" or group.layout.ffn % etp):
            excluded = (f"expert TP needs 3-D expert weights with F divisible by {tp_name}={etp} "
                        f"(kind {group.layout.kind}, F={group.layout.ffn})")
        elif group.layout.kind != "stacked":
            excluded = "a ModuleList of experts: the planner shards only 3-D expert weights (FSDP cannot wrap " \
                       "the meta parameters ExpertParallel leaves on the other ranks)"
        colls: list[Collective] = []
        if excluded is None:
            try:
                per_layer = style.predicted_collectives(tokens=tokens, hidden=group.layout.hidden,
                                                        ffn=group.layout.ffn, top_k=group.top_k,
                                                        experts=group.experts, dtype_bytes=dtype_bytes, ep=ep, tp=etp)
                colls = [dataclasses.replace(c, count=c.count * n) for c in per_layer]
            except HyperParallelError as exc:
                excluded = str(exc)
        compute = expert_time(ctx, group, tokens=tokens, dtype_bytes=dtype_bytes, ep=ep, etp=etp,
                              runtime=runtime) * n * imbalance
        comm = sum(ctx.collective_time(c) for c in colls)
        reason = (f"{-(-group.experts // ep)} of {group.experts} experts per rank, "
                  f"tokens by all-to-all over {ep_name}" + (f", expert weights split over {tp_name}" if etp > 1 else ""))
        state = ctx.state_bytes(group.param_bytes * n, ep * etp)
        local = max(group.experts // ep, 1)
        if ctx.fsdp and ctx.dp > 1 and local % ctx.dp:
            # FSDP2 shards dim 0 (the E/ep local experts) over dp, padded: with fewer local experts
            # than dp ranks each rank still holds a whole expert (what the plan's exact bytes show)
            pad = -(-local // ctx.dp) * ctx.dp / local
            state = {k: v * pad for k, v in state.items()}
        out.append(ExpertOption(name, style, colls, compute, comm, state, reason, excluded))
    return out


def choose_experts(groups: list[MoEGroup], ctx, *, memory_room: float | None = None,
                   expert_parallel: bool | None = None, **shape) -> ExpertChoice:
    """Per group the fastest option whose expert state fits ``memory_room`` (bytes left per rank
    after everything else; None: no limit); the smallest-state option when none fits.
    ``expert_parallel``: True keeps only the ExpertParallel options, False only replicated
    experts (a constraint, as ``fsdp=`` is); None prices both. ``shape``: what
    :func:`expert_options` prices each group at (tokens, dtype_bytes, the ep and tp dimensions,
    imbalance, runtime)."""
    imbalance = shape.get("imbalance", 1.0)
    chosen, options, base = [], [], 0.0
    for g in groups:
        opts = expert_options(g, ctx, **shape)
        for o in opts:
            if o.excluded is None and expert_parallel is not None and (o.style is not None) != expert_parallel:
                o.excluded = f"expert_parallel={expert_parallel} was asked"
        runnable = [o for o in opts if o.excluded is None] or opts[:1]
        room = None if memory_room is None else memory_room / max(len(groups), 1)
        fits = [o for o in runnable if room is None or o.state_bytes <= room]
        pick = min(fits, key=lambda o: (o.step_s, o.state_bytes)) if fits else \
            min(runnable, key=lambda o: (o.state_bytes, o.step_s))
        chosen.append(pick)
        options.append(opts)
        base += ctx.compute_time(g.work, 1) * g.count   # what the TP search counted for these experts
    notes = [f"expert parallel: routing imbalance factor {imbalance:g} assumed (the busiest rank's expert "
             f"compute / the balanced share; 1.0 = balanced routing)"]
    for g, pick, opts in zip(groups, chosen, options):
        others = ", ".join(f"{o.name} {o.step_s:.3g}s/{o.state_bytes / 2**30:.3g}GiB"
                           + (f" (excluded: {o.excluded})" if o.excluded else "") for o in opts if o is not pick)
        notes.append(f"{g.pattern}: {pick.name} ({pick.reason}): {pick.step_s:.3g}s per step, expert state "
                     f"{pick.state_bytes / 2**30:.3g} GiB per rank; vs {others}")
    return ExpertChoice(shape["ep_name"], groups, chosen, options, imbalance, base, notes)


def expert_decision_rows(choice: ExpertChoice) -> list[dict]:
    """One plan decision row per MoE group, with every candidate (for ``explain``)."""
    rows = []
    for g, pick, opts in zip(choice.groups, choice.chosen, choice.options):
        rows.append({
            "unit": f"{g.pattern}/experts", "block_prefix": g.block_prefix, "count": g.count,
            "strategy": pick.name, "stream": "-", "reason": pick.reason, "modules": [g.pattern],
            "compute_s": pick.compute_s, "comm_s": pick.comm_s, "memory_bytes": int(round(pick.state_bytes)),
            "module": g.pattern,
            "options": [{"strategy": o.name, "stream": "-", "compute_s": o.compute_s, "comm_s": o.comm_s,
                         "memory_bytes": int(round(o.state_bytes)), "reason": o.reason, "excluded": o.excluded}
                        for o in opts]})
    return rows
