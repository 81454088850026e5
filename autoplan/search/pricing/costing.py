"""Prices of strategies: compute (roofline on the hardware profile), collectives (alpha-beta per
mesh dimension from cost_models), and per-rank memory (parameters, gradients, AdamW state,
saved activations). One place, so the ILP and the plan's predictions never disagree.

On the measured ``cpu`` profile the ranks are eager processes sharing the host, and what
dominates a step there is not in a datasheet roofline. When this host has a runtime calibration
for the mesh's world size (:func:`cost_models.runtime.calibrate_runtime`, cached per host and
world) the context picks it up and prices, all measured on that many concurrent gloo ranks:

- compute: roofline time x ``compute_scale`` (one-thread ranks sharing the host's cores, measured
  on GEMMs run by that many ranks at once), plus
  ``op_s`` per kernel (eager dispatch + autograd) and, in units whose weights are sharded (their
  ops run on DTensors), ``dtensor_op_s`` per kernel on top;
- collectives: ring alpha-beta on the calibrated gloo link, plus ``collective_s`` per call for
  issuing it through DTensor.

On datasheet profiles (h100_sxm, ...) compute is priced per op class by cost_models: each GEMM
or fused-attention op at its shape's achieved efficiency (``cost_models.compute.gemm_efficiency``),
every other op by its bytes at achieved HBM bandwidth, plus a launch cost per kernel -- summed,
so norms, softmax and elementwise time no longer vanish under the GEMMs. Data-parallel modes
(``replicate`` / ``zero1`` / ``fsdp``) and recomputation (``none`` / ``selective`` / ``full``) are
fields of the context, and so is the AdamW step (:meth:`CostContext.optimizer_time`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from hyper_parallel.core.collective import Collective
from autoplan.search.units.work import Work
from cost_models.collectives import collective_terms
from cost_models.compute import ATTENTION, ATTENTION_CAUSAL, attention_time, gemm_efficiency, sharded_gemm_dims
from cost_models.overlap import DP_MODES, dp_overlap, fused_collective_matmul
from cost_models.precision import float8_gemm_s, float8_peak
from cost_models.runtime import load_runtime

log = logging.getLogger(__name__)
_AUTO = "auto"
RECOMPUTE = ("none", "selective", "full")
FLOAT8_MODES = ("", "auto", "tensorwise", "rowwise")


@dataclass
class CostContext:
    hardware: object            # cost_models HardwareProfile
    topology: object            # cost_models MeshTopology
    dtype: str                  # compute dtype, e.g. "bf16"
    tp_dim: str
    dp_dim: str | None
    dp: int
    fsdp: bool
    param_bytes_per_element: int
    optimizer_bytes_per_element: int   # AdamW: 2 fp32 states (+ fp32 master weights for 16-bit params)
    checkpoint_blocks: bool = False    # full activation checkpointing of every repeated block
    # "replicate" | "zero1" | "fsdp" ("" = from ``fsdp``); "none" | "selective" | "full"
    # ("" = none or full, from ``checkpoint_blocks``)
    dp_mode: str = ""
    recompute: str = ""
    # cost_models.runtime.RuntimeOverheads of eager ranks on this host; "auto": the cached
    # calibration for the mesh's world size when the hardware is the measured cpu profile
    runtime: object = _AUTO
    # async tensor parallelism (inductor's micro-pipeline TP): a sequence-parallel unit's
    # collectives fused with their matmuls where torch's pass fuses them (fused_tp_time)
    async_tp: bool = False
    # float8 Linears (cost_models.precision): "" none; "auto" each capable weight GEMM in float8
    # (tensorwise) where that is cheaper at the shape a rank runs; "tensorwise" / "rowwise": every
    # capable one in that recipe. ``compiled``: the casts run compiled (one pass each, not two)
    float8: str = ""
    compiled: bool = False
    # collective_time per (collective, latency): the cluster search prices the same rows on one
    # context hundreds of thousands of times (DeepSeek-V3 at 2,048 devices: 0.8 M calls); a
    # context's mesh and link model do not change after it is made (dataclasses.replace makes a new one)
    _collective_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.dp_mode:
            self.dp_mode = "fsdp" if self.fsdp else "replicate"
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"CostContext: dp_mode={self.dp_mode!r} is not one of {DP_MODES}")
        self.fsdp = self.dp_mode == "fsdp"
        # recompute "" stays "": ``checkpoint_blocks`` says none/full, so that
        # ``dataclasses.replace(ctx, checkpoint_blocks=...)`` (autoplan's two-way enumeration) works
        if self.recompute and self.recompute not in RECOMPUTE:
            raise ValueError(f"CostContext: recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.recompute:
            self.checkpoint_blocks = self.recompute == "full"
        if self.runtime == _AUTO:
            self.runtime = self._auto_runtime()
        if self.float8 not in FLOAT8_MODES:
            raise ValueError(f"CostContext: float8={self.float8!r} is not one of {FLOAT8_MODES}")

    def _auto_runtime(self):
        hw = self.hardware
        if getattr(hw, "device_type", None) != "cpu" or getattr(hw, "name", None) != "cpu":
            return None
        world = math.prod(d.size for d in self.topology.dims)
        rt = load_runtime(world)
        if rt is None:
            log.info("costing: no runtime calibration of this host for %d ranks (python -m cost_models.runtime "
                     "--world %d); pricing with the bare cpu profile", world, world)
        return rt

    @classmethod
    def with_runtime(cls, runtime, **fields) -> "CostContext":
        """A context with an explicit runtime calibration (None: none, even on cpu)."""
        return cls(runtime=runtime, **fields)

    def compute_time(self, work: Work, shard: int, split_tokens: bool = False) -> float:
        """Seconds per call of ``work`` on one rank of a ``shard``-way split: of the weights
        (tensor parallel, the default) or of the tokens (``split_tokens``: per-token work on a
        sequence shard, each GEMM's M divided)."""
        hw = self.hardware
        eff = hw.efficiency
        t_flop = work.flops / shard / (hw.peak(self.dtype) * eff.compute)
        t_mem = work.bytes / shard / (hw.memory_bandwidth * eff.memory)
        rt = self.runtime
        if rt is None:
            if not (work.gemms or work.other_bytes):  # no op-class split (a hand-made Work)
                return max(t_flop, t_mem) + work.kernels * eff.kernel_overhead
            return self._op_class_time(work, shard, split_tokens)
        per_kernel = rt.op_s + (rt.dtensor_op_s if shard > 1 else 0.0)
        # a compiled chain's kernel pays neither dispatch nor an autograd node of its own: what the
        # host's profile measured for one (cost_models.chain_timing), where it did
        fused = work.fused_kernels if eff.fused_kernel_overhead > 0 else 0
        # one measured scale for both terms: streaming microbenchmarks (rt.memory_scale) run from
        # cache and under-price a model's memory-bound eager ops ~4x (see cost_models.runtime)
        return (rt.compute_scale * max(t_flop, t_mem) + (work.kernels - fused) * per_kernel
                + fused * eff.fused_kernel_overhead)

    def _op_class_time(self, work: Work, shard: int, split_tokens: bool = False) -> float:
        """GEMMs at their per-rank shape's achieved efficiency + every other op at achieved HBM
        bandwidth + kernel launches. A tensor-parallel shard divides a weight GEMM's N or K
        (``cost_models.compute.gemm_split``): the rank runs a narrower GEMM, which fills the
        device less well -- at tp 8 the attention projections of a 6144-wide model run at
        N = 768, 12 % slower per FLOP than at full width on the profile's shape curve."""
        hw = self.hardware
        peak = hw.peak(self.dtype)
        t, gflops, float8_t = 0.0, 0.0, 0.0
        for f, m, n, k, *split in work.gemms:
            gflops += f
            if split and split[0] in (ATTENTION, ATTENTION_CAUSAL):   # heads are its batch: a shard divides f
                sq = m / shard if split_tokens else m
                t += attention_time(hw, peak, f, sq, n, k, split[0] == ATTENTION_CAUSAL,
                                    split[1] if len(split) > 1 else None)
                continue
            dims = (m / shard, n, k) if split_tokens else sharded_gemm_dims(m, n, k, split[0] if split else "", shard)
            if self.float8 and len(split) > 2 and split[2]:   # a Linear that may run in float8: its casts are per rank
                float8_t += self.weight_gemm(f / shard, dims)[0]
                continue
            t += f / (peak * gemm_efficiency(hw, *dims))
        t += max(work.flops - gflops, 0.0) / (peak * hw.efficiency.compute)
        t += work.other_bytes / (hw.memory_bandwidth * hw.efficiency.memory)
        return t / shard + float8_t + work.kernels * hw.efficiency.kernel_overhead

    def weight_gemm(self, flops: float, dims: tuple) -> tuple[float, bool]:
        """(seconds, in float8?) of one float8-capable Linear's three GEMMs on one rank (``flops``:
        this rank's share, ``dims``: its per-rank M, N, K) under this context's ``float8``: the
        float8 price with its casts (``cost_models.precision.float8_gemm_s``) where the recipe is
        forced or, under "auto", where it is cheaper than the high-precision GEMM."""
        hw = self.hardware
        high = flops / (hw.peak(self.dtype) * gemm_efficiency(hw, *dims))
        recipe = "tensorwise" if self.float8 == "auto" else self.float8
        low = float8_gemm_s(hw, flops, *dims, recipe=recipe, hp_bytes=4 if "32" in self.dtype else 2,
                            compiled=self.compiled) if self.float8 else None
        if low is None or (self.float8 == "auto" and low >= high):
            return high, False
        return low, True

    def gemm_peak(self, flops: float, dims: tuple, capable: bool) -> float:
        """The peak one weight GEMM runs at: the float8 one where this context runs it in float8
        (``weight_gemm``), else the compute dtype's."""
        if capable and self.float8 and self.weight_gemm(flops, dims)[1]:
            return float8_peak(self.hardware, "tensorwise" if self.float8 == "auto" else self.float8)
        return self.hardware.peak(self.dtype)

    def float8_gathered(self, work: Work, shard: int, split_tokens: bool = False) -> float:
        """Weight elements of ``work`` (unsharded) that FSDP gathers in float8: the tensorwise float8
        Linears (torchao's float8 all-gather; rowwise weights gather in high precision)."""
        if not (self.float8 in ("auto", "tensorwise") and self.fsdp):
            return 0.0
        out = 0.0
        for f, m, n, k, *split in work.gemms:
            if len(split) > 2 and split[2]:
                dims = (m / shard, n, k) if split_tokens else sharded_gemm_dims(m, n, k, split[0], shard)
                out += n * k if self.weight_gemm(f / shard, dims)[1] else 0.0
        return out

    def recompute_time(self, work: Work, shard: int, split_tokens: bool = False) -> float:
        """Extra seconds per call that recomputation adds in backward: the whole forward (full:
        a third of forward + backward) or the attention core's forward (selective)."""
        if self.checkpoint_blocks:
            return self.compute_time(work, shard, split_tokens) / 3.0
        if self.recompute == "selective" and work.core is not None:
            return self.compute_time(work.core, shard, split_tokens) / 3.0
        return 0.0

    def optimizer_time(self, param_tensors: int, elements: float, sharded: bool) -> float:
        """AdamW step for ``param_tensors`` tensors holding ``elements`` elements on this rank.

        Bandwidth-bound per element (fp32 states: read p, g, m, v and write p, m, v), plus a fixed
        cost per tensor from the runtime calibration (much larger for DTensor parameters).
        Charged once per step after backward (not overlapped) by every search path.
        """
        hw = self.hardware
        nbytes = 28.0 * elements
        t_mem = nbytes / (hw.memory_bandwidth * hw.efficiency.memory)
        rt = self.runtime
        if rt is None:
            return t_mem + param_tensors * hw.efficiency.kernel_overhead
        per = rt.optimizer_dtensor_tensor_s if sharded else rt.optimizer_tensor_s
        return rt.compute_scale * t_mem + param_tensors * per

    def collective_time(self, c: Collective, latency: bool = True) -> float:
        """Seconds for ``c`` (all its calls). ``latency=False``: the bandwidth term only, for
        collectives whose calls are fused with others' (FSDP: a block's units share one all-gather;
        price the calls once with :meth:`fsdp_latency_time`)."""
        key = (c.kind, c.nbytes, c.count, c.dim, latency)
        memo = self._collective_memo.get(key)
        if memo is None:
            memo = self._collective_memo[key] = self._collective_time(c, latency)
        return memo

    def _collective_time(self, c: Collective, latency: bool) -> float:
        if c.nbytes <= 0:
            return 0.0
        dim = self.tp_dim if c.dim == "tp" else c.dim
        if dim not in self.topology.names or self.topology[dim].size == 1:
            return 0.0
        md = self.topology[dim]
        terms = collective_terms(c.kind, c.nbytes, md.size)
        rt = self.runtime
        if rt is None:
            if latency:
                return c.count * md.time(c.kind, c.nbytes)
            return c.count * terms.wire_bytes / md.bus_bandwidth(c.kind, c.nbytes)
        if latency:
            return c.count * (terms.time(rt.link) + rt.collective_s)
        return c.count * terms.wire_bytes / rt.link.bandwidth

    def fused_tp_time(self, c: Collective, gemms: list, shard: int) -> float:
        """Seconds collective ``c`` (all its calls) still costs fused with ``gemms`` -- the one pass
        (a third of the forward + backward FLOPs each entry holds) of the matmuls beside it, at
        their per-rank shape -- under async TP (``cost_models.overlap.fused_collective_matmul``,
        each chunk priced at M / tp). No GEMMs beside it: fully exposed, as without async TP."""
        comm = self.collective_time(c)
        if not gemms or shard <= 1 or c.count <= 0:
            return comm
        whole = chunk = 0.0
        for f, m, n, k, *split in gemms:
            pm, pn, pk = sharded_gemm_dims(m, n, k, split[0] if split else "", shard)
            # a float8 GEMM is half as long, so it hides half as much (its casts are kernels of their own)
            peak = self.gemm_peak(f / shard, (pm, pn, pk), len(split) > 2 and split[2])
            one = f / 3 / shard   # one pass of this rank's share
            whole += one / (peak * gemm_efficiency(self.hardware, pm, pn, pk))
            chunk += one / shard / (peak * gemm_efficiency(self.hardware, pm / shard, pn, pk))
        per_call = fused_collective_matmul(comm / c.count, whole, chunk, shard)
        return c.count * per_call

    def fsdp_latency_time(self, fsdp_units: int) -> float:
        """The per-call part of FSDP's collectives: ``fsdp_units`` wrapped modules (each repeated
        block and the root), each all-gathering in forward and backward and reduce-scattering in
        backward. Independent of the tensor-parallel choice; with :meth:`collective_time`
        ``latency=False`` for the per-unit bytes it prices FSDP as the runner issues it."""
        if not self.fsdp or self.dp <= 1 or fsdp_units <= 0 or self.dp_dim not in self.topology.names:
            return 0.0
        md = self.topology[self.dp_dim]
        rt = self.runtime
        alpha = rt.link.latency if rt is not None else md.link.latency
        extra = rt.collective_s if rt is not None else 0.0
        per_unit = sum(collective_terms(k, 1.0, md.size).latency_steps * alpha + extra
                       for k in ("all_gather", "all_gather", "reduce_scatter"))
        return fsdp_units * per_unit

    def comm_time(self, collectives: list[Collective], latency: bool = True) -> float:
        return sum(self.collective_time(c, latency) for c in collectives)

    def state_bytes(self, param_bytes: float, param_shard: int) -> dict[str, float]:
        """Parameters, gradients and optimizer state per rank for ``param_bytes`` of weights:
        FSDP shards all three over dp, ZeRO-1 the optimizer state only."""
        elements = param_bytes / self.param_bytes_per_element / param_shard
        fsdp = self.dp if self.fsdp else 1
        opt = self.dp if self.dp_mode in ("fsdp", "zero1") else 1
        return {"params": elements * self.param_bytes_per_element / fsdp,
                "grads": elements * self.param_bytes_per_element / fsdp,
                "optimizer": elements * self.optimizer_bytes_per_element / opt}

    def optimizer_elements(self, param_bytes: float, param_shard: int) -> float:
        """Parameter elements this rank's optimizer updates (sharded by FSDP and ZeRO-1)."""
        elements = param_bytes / self.param_bytes_per_element / param_shard
        return elements / (self.dp if self.dp_mode in ("fsdp", "zero1") else 1)

    def exposed_dp(self, dp_comm: float, compute: float) -> float:
        """Data-parallel seconds compute cannot hide, for this context's dp mode."""
        return dp_overlap(self.dp_mode).exposed(dp_comm, compute)

    def fsdp_collectives(self, param_bytes: float, param_shard: int, float8_elements: float = 0.0) -> list[Collective]:
        """FSDP over the dp dimension for one wrapped unit: all-gather in forward and again in
        backward (reshard after forward), reduce-scatter of gradients. ``float8_elements`` of its
        weights (unsharded) are gathered in one byte each (``float8_gathered``)."""
        if not self.fsdp or self.dp <= 1 or param_bytes <= 0:
            return []
        b = int(param_bytes / param_shard)
        g = int(max(param_bytes - float8_elements * (self.param_bytes_per_element - 1), 0) / param_shard)
        return [Collective("all_gather", "forward", g, dim=self.dp_dim),
                Collective("all_gather", "backward", g, dim=self.dp_dim),
                Collective("reduce_scatter", "backward", int(b * self.reduce_scale), dim=self.dp_dim)]

    @property
    def reduce_scale(self) -> float:
        """Gradient bytes on the wire per parameter byte: 16-bit models reduce gradients in fp32
        (FSDP2's mixed-precision policy and ZeRO-1 as the runners apply them; Megatron-LM and
        torchtitan do the same)."""
        return 4.0 / self.param_bytes_per_element if self.param_bytes_per_element < 4 else 1.0

    def ddp_collectives(self, param_bytes: float, param_shard: int) -> list[Collective]:
        """Replicated dp: one all-reduce of the gradients; ZeRO-1: reduce-scatter of the
        gradients, all-gather of the updated parameters (same bytes on the wire)."""
        if self.fsdp or self.dp <= 1 or param_bytes <= 0:
            return []
        b = int(param_bytes / param_shard)
        if self.dp_mode == "zero1":
            return [Collective("reduce_scatter", "backward", int(b * self.reduce_scale), dim=self.dp_dim),
                    Collective("all_gather", "backward", b, dim=self.dp_dim)]
        return [Collective("all_reduce", "backward", b, dim=self.dp_dim)]
