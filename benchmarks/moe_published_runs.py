"""Published mixture-of-experts training runs priced by the planner's cost model at their own layouts.

Every run below is bf16, with a stated layout (dp, ep, pp, tp, virtual stages, micro-batch) and a
measured step time or throughput, each with its source. Each is priced through the public planner:
``plan_cluster(model, devices, batch=..., hardware=..., constraints=...)`` with the published layout
(dp, ep, pp, tp, micro-batch size, dp mode, schedule, virtual stages) and what the source states of its
runtime as constraints (recomputation; ``expert_runtime``: how it moves and keeps the experts' tokens
-- DeepEP's per-node de-duplication, DeepSeek-V3's node-limited routing and DualPipe overlap, fused
kernels' saved activations; ``attention_kernel``; ``loss_bytes_per_logit``), at the device's memory:
a layout that ran must fit. The plan's predicted step is split by term (busy compute + exposed TP/EP
traffic, pipeline bubble, data-parallel + optimizer), and autoplan's own pick for the same model,
devices and batch (hyper_parallel's runtime) is reported with its claimed speed-up and the terms it
comes from. No constant is fitted to these runs, so the leave-one-source-out ratio is the ratio (see
docs/costs.md). Pipeline cuts as the recipe makes them (``cuts="even"``) where it states them; where
those do not fit the device the planner's cuts are taken and the row says so (``error``).

Sources: NeMo AutoModel's performance summary (H100, FSDP2 + EP, step times), Megatron-Bridge's
performance summary (H100 and B200, Megatron-Core, tokens/s/GPU), DeepSeek-V3's technical report
(2,048 H800, EP64 PP16, step time implied by its GPU-hours).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_published_runs.py [--only NAME] [--no-free]

Writes benchmarks/results/moe_published_runs.{csv,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from autoplan.presets import build_preset, use_fused_attention
from autoplan.review.compare import compare_plans
from autoplan.search.experts.search import DEEPEP_RUNTIME, DEEPSEEK_V3_RUNTIME, OUR_EXPERT_RUNTIME, ExpertRuntime
from cost_models.hardware import load_hardware

OUT = Path(__file__).parent / "results" / "moe_published_runs"
AUTOMODEL = ("NVIDIA-NeMo/Automodel docs/performance-summary.md (2025-10-02), Pre-Training, DGX-H100, BF16, "
             "'Time per Global Step (s)'; fake balanced gate (balanced routing), TE + DeepEP")
BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary{f}.md, {rel} NeMo container, {sys}, BF16, "
          "Tokens/sec/GPU; MoE benchmarks force-balanced, dropless")
DSV3 = ("DeepSeek-AI, DeepSeek-V3 Technical Report (arXiv 2412.19437): sec. 3.2 (2,048 H800, PP16, EP64 over 8 "
        "nodes, ZeRO-1, no TP), 180K H800 GPU-hours per trillion tokens (Table 1 / sec. 1), final batch 15,360 x "
        "4,096: 15,360 x 4,096 x 180e3 x 3600 / 1e12 / 2,048 = 19.9 s per step")


@dataclass
class Run:
    name: str
    source: str            # the publication (leave-one-source-out groups by it)
    cite: str
    model: tuple           # (preset, overrides) for build_preset
    hardware: str
    devices: int
    gbs: int
    seq: int
    dp: int                # data parallel outside ep (dp x ep x pp x tp = devices)
    ep: int
    pp: int
    tp: int
    mbs: int
    dp_mode: str
    measured_s: float
    schedule: str = "1F1B"
    v: int = 1
    their_runtime: list = field(default_factory=list)   # what their runtime does that ours does not
    # how their runtime moves the experts' tokens, as the source states it (priced: "their runtime,
    # not ours"); ours (every routed copy, exposed) unless the source says otherwise
    expert_runtime: ExpertRuntime = OUR_EXPERT_RUNTIME
    # what the source's recipe states (None: not stated -- the fastest of none / selective / full
    # is taken) and how its runtime cuts the pipeline ("even": blocks spread evenly, the embedding
    # with the first stage, norm and head with the last, as Megatron-Core and AutoModel's
    # AutoPipeline split; "balanced": not stated, the planner's balanced cuts)
    recompute: str | None = None
    cuts: str = "balanced"
    # the loss's HBM bytes per logit in the source's runtime (None: as ours, torch's F.cross_entropy
    # on the logits' dtype -- AutoModel's MaskedCrossEntropy with fp32_upcast: false is that)
    loss_bytes_per_logit: float | None = None
    # memory settings the source states (memory_cite): Megatron-Core recompute_modules, fused
    # kernels' saved activations, non-expert state over dp x ep (see autoplan.search.experts.memory)
    recompute_modules: tuple = ()
    fused_saves: bool = False
    fp8_cache: bool = False
    dense_state_over_ep: bool | None = None
    memory_cite: str = ""
    # the fused-attention kernel the source's runtime runs where it is not the profile's flash class
    # (cost_models.attention_kernels: AutoModel's GPT-OSS recipes state ``attn: flex``)
    attention_kernel: str | None = None

    def runtime(self) -> ExpertRuntime:
        """The expert runtime with the memory facts this run's source states."""
        over = dict(fused_saves=self.fused_saves, recompute_modules=tuple(self.recompute_modules),
                    fp8_cache=self.fp8_cache)
        if self.dense_state_over_ep is not None:
            over["dense_state_over_ep"] = self.dense_state_over_ep
        return dataclasses.replace(self.expert_runtime, **over)


QWEN3_30B = ("qwen3-moe-30b-a3b", {})
GPT_OSS_20B = ("gpt-oss-20b", {})
GPT_OSS_120B = ("gpt-oss-20b", dict(num_hidden_layers=36, num_local_experts=128))
DEEPSEEK_V3 = ("deepseek-v3", {})
KIMI_K2 = ("deepseek-v3", dict(n_routed_experts=384, first_k_dense_replace=1, num_attention_heads=64,
                               num_key_value_heads=64, n_group=1, topk_group=1, vocab_size=163840))
DEEPEP = "DeepEP dispatch/combine kernels (NVLink + RDMA, per-node de-duplication; priced: expert_runtime)"
# NeMo AutoModel's performance-summary runs: DeepEP (as DEEPEP_RUNTIME) under the recipes' fake balanced
# gate, which routes token t to the k consecutive experts (t * k + j) mod E -- one or two ranks of one
# node -- so DeepEP's per-rank / per-node de-duplication sends most tokens once
AUTOMODEL_RUNTIME = dataclasses.replace(
    DEEPEP_RUNTIME, routing="contiguous",
    source=DEEPEP_RUNTIME.source + "; nemo_automodel/components/moe/layers.py FakeBalancedGate (fake_balanced_gate: "
    "true in every examples/benchmark/configs/*_te_deepep.yaml at the summary's commit 8d9bfb90e): indices = "
    "arange(tokens * k).view(-1, k) % E")
FAKE_GATE = "fake balanced gate: each token's k experts consecutive (priced: expert_runtime routing)"
# the GPT-OSS recipes' ``backend: attn: flex`` (examples/benchmark/configs/gptoss_*_te_deepep.yaml)
FLEX = "FlexAttention (sinks, sliding window 128 on half the layers; priced: attention_kernel)"
# what the recipes state, at the commits the summaries were written from
AM_AC = ("full: activation_checkpointing: true in examples/benchmark/configs/{f}.yaml (Automodel 8d9bfb90e, "
         "2025-10-08): parallelizer.apply_ac wraps every decoder block in ptd_checkpoint_wrapper")
AM_NO_AC = "none: activation_checkpointing: false in examples/benchmark/configs/gptoss_120b_te_deepep.yaml (8d9bfb90e)"
MB_AC = ("none: recompute_modules ['layernorm', 'moe_act'] only (Megatron-Bridge scripts/performance/configs/gpt_oss/"
         "workload_base_configs.py at v0.2.0 = 25.11, gpt_oss_workload_base_configs.py at v0.3.0 = 26.02: the V2 configs inherit it): the norms and the expert "
         "activation recomputed in backward, HBM-bound elementwise work under 1 % of the step, not priced")
# Megatron-Core's fused vocab-parallel cross entropy (cross_entropy_loss_fusion = True in Megatron-Bridge's
# GPTModelProvider, fp16_lm_cross_entropy = False): megatron/core/fusions/fused_cross_entropy.py's jit-fused
# steps over tensor_parallel/cross_entropy.py run in fp32 -- logits.float() with the max (read 2, write 4),
# minus the max, exp in place and the sum (read 4, write 4), the softmax normalised in place (read 4,
# write 4); backward scales the saved fp32 softmax in place (read 4, write 4) and the cast's backward writes
# bf16 (read 4, write 2): 36 B per logit, against 12 for torch's F.cross_entropy on bf16 logits
MEGATRON_CE_BYTES = 36.0
MEGATRON_CE = ("Megatron-Core fused vocab-parallel cross entropy in fp32 (36 B per logit; priced: "
               "loss_bytes_per_logit)")
EVEN_MB = "Megatron-Core's default split: decoder layers evenly over stages, embedding first, output layer last"
EVEN_AM = ("AutoModel AutoPipeline (pipelining/functional.py generate_hf_model_fqn_per_model_part): layers evenly over "
           "ceil(L / layers_per_stage) + 1 stages, extras to the first, embedding first, norm + lm_head last")
TE = "Transformer Engine fused kernels (grouped GEMM, fused permute, fused attention)"
# Megatron-Core's alltoall token dispatcher as the Megatron-Bridge GPT-OSS recipes run it
# (moe_token_dispatcher_type "alltoall", moe_permute_fusion True: GPTOSSProvider): every routed copy
# over NCCL's all-to-all, as ours; the received rows sorted by local expert and back
# (token_dispatcher.py sort_chunks_by_idxs, TE's fused kernel); the routing weights folded into TE's
# fused unpermute, not a pass of their own as ours
MEGATRON_A2A = dataclasses.replace(
    OUR_EXPERT_RUNTIME, weights_apart=False, bias_passes=(0, 12),
    source="Megatron-Core MoEAlltoAllTokenDispatcher (moe_permute_fusion): all-to-alls of every routed copy, "
           "exposed; rows re-sorted by local expert around them (sort_chunks_by_idxs); weights fused into the "
           "unpermute; TEGroupedMLP: the gate/up bias fused into weighted_bias_quick_geglu_impl "
           "(bias_activation_fusion), the down bias scaled by the routing weights in _apply_bias (split per "
           "expert, t + b * p, concatenated: 6 passes forward, 6 backward)")
DSV3_RUNTIME = DEEPSEEK_V3_RUNTIME


def bridge_step(gbs, seq, tps, n):
    return gbs * seq / (tps * n)


RUNS = [
    Run("am-dsv3-1024", "automodel", AUTOMODEL + ": DeepSeek V3 671B, 1024 GPUs, GBS 8192, MBS 1, PP 4, EP 64, VP 8, "
        "FSDP 256: 37.87 s", DEEPSEEK_V3, "h100_sxm", 1024, 8192, 4096, 4, 64, 4, 1, 1, "fsdp", 37.87,
        "Interleaved1F1B", 8, [DEEPEP, TE, FAKE_GATE], AUTOMODEL_RUNTIME,
        recompute="full", cuts="even"),
    Run("am-dsv3-256", "automodel", AUTOMODEL + ": DeepSeek V3 671B, 256 GPUs, GBS 512, MBS 1, PP 4, EP 64, VP 8, "
        "FSDP 64: 8.18 s", DEEPSEEK_V3, "h100_sxm", 256, 512, 4096, 1, 64, 4, 1, 1, "fsdp", 8.18,
        "Interleaved1F1B", 8, [DEEPEP, TE, FAKE_GATE], AUTOMODEL_RUNTIME, recompute="full", cuts="even"),
    Run("am-kimik2-256", "automodel", AUTOMODEL + ": Kimi K2, 256 GPUs, GBS 512, MBS 1, PP 8, EP 32, VP 4, FSDP 32: "
        "8.86 s", KIMI_K2, "h100_sxm", 256, 512, 4096, 1, 32, 8, 1, 1, "fsdp", 8.86, "Interleaved1F1B", 4,
        [DEEPEP, TE, FAKE_GATE], AUTOMODEL_RUNTIME, recompute="full", cuts="even"),
    Run("am-qwen3-30b-8", "automodel", AUTOMODEL + ": Qwen3 MoE 30B, 8 GPUs, GBS 512, MBS 4, EP 8, FSDP 8: 21.773 s",
        QWEN3_30B, "h100_sxm", 8, 512, 4096, 1, 8, 1, 1, 4, "fsdp", 21.773, their_runtime=[DEEPEP, TE, FAKE_GATE],
        expert_runtime=AUTOMODEL_RUNTIME, recompute="full"),
    Run("am-gptoss-20b-8", "automodel", AUTOMODEL + ": GPT-OSS 20B, 8 GPUs, GBS 256, MBS 2, EP -, FSDP 8: 10.04 s "
        "(EP 8: the row's recipe examples/benchmark/configs/gptoss_20b_te_deepep.yaml sets ep_size 8)",
        GPT_OSS_20B, "h100_sxm", 8, 256, 4096, 1, 8, 1, 1, 2, "fsdp", 10.04,
        their_runtime=[DEEPEP, TE, FAKE_GATE, FLEX], expert_runtime=AUTOMODEL_RUNTIME, recompute="full",
        attention_kernel="flex_attention"),
    Run("am-gptoss-120b-64", "automodel", AUTOMODEL + ": GPT-OSS 120B, 64 GPUs, GBS 512, MBS 2, EP -, FSDP 64: "
        "4.30 s (EP 64: its recipe gptoss_120b_te_deepep.yaml sets ep_size 64)", GPT_OSS_120B, "h100_sxm", 64, 512,
        4096, 1, 64, 1, 1, 2, "fsdp", 4.30,
        their_runtime=[DEEPEP, TE, FAKE_GATE, FLEX], expert_runtime=AUTOMODEL_RUNTIME, recompute="none",
        attention_kernel="flex_attention"),
    Run("mb-gptoss-120b-h100-2602", "bridge", BRIDGE.format(f="-archive", rel="26.02", sys="DGX-H100") +
        ": GPT OSS 120B, 64 GPUs, GBS 1280, MBS 1, seq 4096, PP 4, EP 8: 5,993", GPT_OSS_120B, "h100_sxm", 64, 1280,
        4096, 2, 8, 4, 1, 1, "zero1", bridge_step(1280, 4096, 5993, 64), their_runtime=[TE, MEGATRON_CE], expert_runtime=MEGATRON_A2A,
        recompute="none", loss_bytes_per_logit=MEGATRON_CE_BYTES,
        cuts="even"),
    Run("mb-gptoss-120b-h100-2511", "bridge", BRIDGE.format(f="", rel="25.11", sys="DGX-H100") +
        ": GPT OSS 120B, 64 GPUs, GBS 512, MBS 4, seq 4096, PP 4, VP 1, EP 8: 5,630", GPT_OSS_120B, "h100_sxm", 64,
        512, 4096, 2, 8, 4, 1, 4, "zero1", bridge_step(512, 4096, 5630, 64), their_runtime=[TE, MEGATRON_CE], expert_runtime=MEGATRON_A2A,
        recompute="none", loss_bytes_per_logit=MEGATRON_CE_BYTES,
        cuts="even"),
    Run("mb-gptoss-120b-b200-2602", "bridge", BRIDGE.format(f="-archive", rel="26.02", sys="DGX-B200") +
        ": GPT OSS 120B, 64 GPUs, GBS 1280, MBS 4, seq 4096, EP 64: 8,047", GPT_OSS_120B, "b200", 64, 1280, 4096,
        1, 64, 1, 1, 4, "zero1", bridge_step(1280, 4096, 8047, 64), their_runtime=[TE, MEGATRON_CE], expert_runtime=MEGATRON_A2A,
        recompute="none", loss_bytes_per_logit=MEGATRON_CE_BYTES),
    Run("mb-gptoss-120b-b200-2511", "bridge", BRIDGE.format(f="", rel="25.11", sys="DGX-B200") +
        ": GPT OSS 120B, 64 GPUs, GBS 512, MBS 4, seq 4096, EP 8: 8,213", GPT_OSS_120B, "b200", 64, 512, 4096, 8, 8,
        1, 1, 4, "zero1", bridge_step(512, 4096, 8213, 64), their_runtime=[TE, MEGATRON_CE], expert_runtime=MEGATRON_A2A,
        recompute="none", loss_bytes_per_logit=MEGATRON_CE_BYTES),
    Run("dsv3-2048-h800", "deepseek", DSV3, DEEPSEEK_V3, "h800", 2048, 15360, 4096, 2, 64, 16, 1, 1, "zero1", 19.9,
        "ZBV", 1, ["FP8 GEMMs (the report's mixed-precision framework; not priced: bf16 here)",
                   "DualPipe: all-to-alls overlapped with the other micro-batch's compute (priced: expert_runtime)",
                   "node-limited routing (<= 4 nodes per token; priced: expert_runtime)", DEEPEP],
        expert_runtime=DSV3_RUNTIME),
]
# the source of each run's stated recompute and cuts (shown in the results)
STATED = {
    "am-dsv3-1024": (AM_AC.format(f="deepseek_v3_te_deepep"), EVEN_AM),
    "am-dsv3-256": (AM_AC.format(f="deepseek_v3_te_deepep"), EVEN_AM),
    "am-kimik2-256": (AM_AC.format(f="kimi_k2_te_deepep"), EVEN_AM),
    "am-qwen3-30b-8": (AM_AC.format(f="qwen3_moe_30b_te_deepep"), ""),
    "am-gptoss-20b-8": (AM_AC.format(f="gptoss_20b_te_deepep"), ""),
    "am-gptoss-120b-64": (AM_NO_AC, ""),
    "mb-gptoss-120b-h100-2602": (MB_AC, EVEN_MB),
    "mb-gptoss-120b-h100-2511": (MB_AC, EVEN_MB),
    "mb-gptoss-120b-b200-2602": (MB_AC, ""),
    "mb-gptoss-120b-b200-2511": (MB_AC, ""),
}

# the recipe as committed when the performance-summary rows were written (8d9bfb90e, 2025-10-08;
# the rows are unchanged since 89e3a9fdd): GPT-OSS-20B's checkpointing went off only on 2025-11-10
AM_CFG = "NVIDIA-NeMo/Automodel@8d9bfb90e examples/benchmark/configs/{f}: {key} activation_checkpointing: {ac}"
AM_FULL = ("; nemo_automodel/components/moe/parallelizer.py apply_ac wraps every decoder block in checkpoint_wrapper "
           "(full recompute)")
AM_RT = ("; TE RMSNorm / attention and grouped experts with the routing weight applied in the activation "
         "(components/moe/experts.py), fused saves; FSDP2 over dp_shard x ep for every non-expert weight "
         "(parallelizer.apply_fsdp)")
MB_CFG = ("NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py "
          "GPT_OSS_120B_PRETRAIN_CONFIG_{gpu}_BF16_V1 (V2 inherits): recompute_modules=['layernorm', 'moe_act']; "
          "Megatron-Core's distributed optimizer shards the non-expert optimizer state over the whole data-parallel "
          "group (dp x ep); TE fused kernels")
DSV3_MEM = ("DeepSeek-V3 tech report sec. 3.2.3: 'we recompute all RMSNorm operations and MLA up-projections during "
            "back-propagation'; sec. 3.3.2 (low-precision storage): the inputs of the Linear after attention cached in "
            "E5M6, the SwiGLU inputs in MoE cached in FP8 and its output recomputed, the MoE up-projection inputs "
            "dispatched and kept in FP8; ZeRO-1 over the data-parallel group (sec. 3.2); DualPipe holds PP + 1 "
            "micro-batches' activations (Table 2), priced as ZBV's in-flight count")


def _automodel(config: str, ac: bool, key: str = "parallelizer") -> dict:
    """AutoModel's recipe: activation checkpointing on (every block, full) or off; TE fused kernels."""
    cite = AM_CFG.format(f=config, key=key, ac=str(ac).lower()) + (AM_FULL if ac else "") + AM_RT
    return dict(recompute="full" if ac else "none", fused_saves=True, memory_cite=cite)


def _bridge(gpu: str, caveat: str = "") -> dict:
    """Megatron-Bridge's GPT-OSS-120B workload: layernorm and moe_act recomputed, distributed optimizer."""
    return dict(recompute="none", recompute_modules=("layernorm", "moe_act"), fused_saves=True,
                dense_state_over_ep=True, memory_cite=MB_CFG.format(gpu=gpu) + caveat)


_MEMORY = {
    "am-dsv3-1024": _automodel("deepseek_v3_te_deepep_1024.yaml", True),
    "am-dsv3-256": _automodel("deepseek_v3_te_deepep.yaml", True),
    "am-kimik2-256": _automodel("kimi_k2_te_deepep.yaml", True, key="distributed"),
    "am-qwen3-30b-8": _automodel("qwen3_moe_30b_te_deepep.yaml", True),
    "am-gptoss-20b-8": _automodel("gptoss_20b_te_deepep.yaml", True),
    "am-gptoss-120b-64": _automodel("gptoss_120b_te_deepep.yaml", False),
    "mb-gptoss-120b-h100-2602": _bridge("H100"),
    "mb-gptoss-120b-h100-2511": _bridge("H100", "; caveat: that configuration runs MBS 1 on H100, the 25.11 row "
                                        "MBS 4 -- the 25.11 release's own H100 settings are not in the stored sources"),
    "mb-gptoss-120b-b200-2602": _bridge("B200"),
    "mb-gptoss-120b-b200-2511": _bridge("B200"),
    "dsv3-2048-h800": dict(recompute="none", recompute_modules=("layernorm", "mla_up_proj", "moe_act"),
                           fused_saves=True, fp8_cache=True, memory_cite=DSV3_MEM),
}
RUNS = [dataclasses.replace(r, **_MEMORY.get(r.name, {})) for r in RUNS]


def build(run: Run):
    """The run's model on meta, its attention captured as one fused kernel (SDPA): every source
    ran fused attention (TE / cuDNN, FlexAttention, FlashAttention), not HF's eager softmax(QK^T)V,
    which materialises the (s x s) scores -- our runtime would run whatever the model's
    ``attn_implementation`` says, so a model left on "eager" is priced as eager."""
    return use_fused_attention(_build(run))


def _build(run: Run):
    preset, over = run.model
    if preset == "qwen3-moe-30b-a3b":   # Qwen/Qwen3-30B-A3B config.json (no preset: built here)
        import transformers
        import torch

        cfg = transformers.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                          num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                                          intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                                          vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg)
    return build_preset(preset, **over)


def constraints(run: Run) -> dict:
    """The published layout and what its source states of its runtime, as ``plan_cluster``'s
    constraints: what a user of the planner writes for this run."""
    cons = dict(dp=run.dp, ep=run.ep, pp=run.pp, tp=run.tp, microbatch_size=run.mbs, dp_mode=run.dp_mode,
                expert_runtime=run.runtime())
    if run.ep > 1:
        cons["expert_parallel"] = True
    if run.recompute:
        cons["recompute"] = run.recompute
    if run.pp > 1:
        cons.update(schedule=run.schedule, virtual_stages=run.v)
        if run.cuts == "even":
            cons["cuts"] = "even"
    if run.attention_kernel:
        cons["attention_kernel"] = run.attention_kernel
    if run.loss_bytes_per_logit:
        cons["loss_bytes_per_logit"] = run.loss_bytes_per_logit
    return cons


def plan_terms(plan) -> dict:
    """A plan's step split as its predictions state it (busy = compute + exposed TP / EP traffic on
    the busiest pipeline rank, the bubble, data-parallel + optimizer) and its memory per rank."""
    pred, pipe = plan.predictions, plan.pipeline or {}
    mem = pred["memory_bytes"]
    g = 2.0 ** 30
    out = {"predicted_s": pred["step_s"], "busy_s": pred["compute_s"], "bubble_s": pred["bubble_s"],
           "dp_and_optimizer_s": pred["comm_s"], "m": pipe.get("microbatches", 1),
           "recompute": plan.recompute.get("mode") if plan.recompute else
           ("full" if plan.activation_checkpointing else "none"),
           "experts_as": (f"ExpertParallel ep{dict(zip(plan.mesh['names'], plan.mesh['shape'])).get('ep')}"
                          if (plan.parallel.get("ep") or {}).get("styles") else "replicated (no ep)"),
           "predicted_mem_gib": mem["total"] / g}
    out.update({f"mem_{k}_gib": mem.get(k, 0) / g for k in ("params", "grads", "optimizer", "activations")})
    out["mem_total_gib"] = mem["total"] / g
    inflight = pipe.get("peak_inflight") or [1]
    out["mem_inflight"] = max(inflight)
    return out


def price(run: Run, free: bool) -> dict:
    """The run priced through the public planner: ``plan_cluster`` with the published layout as
    constraints (the device's memory as the limit: a layout that ran must fit), and -- ``free`` --
    the planner's own pick for the same model, devices and batch, compared term by term."""
    model = build(run)
    row = {"case": run.name, "source": run.source, "hardware": run.hardware, "devices": run.devices,
           "published": f"dp{run.dp}-ep{run.ep}-pp{run.pp}-tp{run.tp} {run.dp_mode} b{run.mbs}"
                        + (f" {run.schedule}(v{run.v})" if run.pp > 1 else ""),
           "measured_s": run.measured_s, "their_runtime": "; ".join(run.their_runtime)}
    t0 = time.perf_counter()
    cons = constraints(run)
    try:
        plan = plan_cluster(model, run.devices, batch=(run.gbs, run.seq), hardware=run.hardware, constraints=cons)
    except InfeasiblePlanError as e:
        row["error"] = str(e)[:300]
        if "cuts" not in cons:
            return row
        # the recipe's even cuts do not fit: the layout with the planner's cuts (said in the row)
        cons.pop("cuts")
        try:
            plan = plan_cluster(model, run.devices, batch=(run.gbs, run.seq), hardware=run.hardware,
                                constraints=cons)
        except InfeasiblePlanError:
            return row
        row["error"] = "even cuts do not fit; priced with the planner's cuts"
    row.update(plan_terms(plan), price_s=time.perf_counter() - t0,
               recompute_modules=",".join(run.recompute_modules), memory_cite=run.memory_cite,
               device_gib=load_hardware(run.hardware).usable_memory() / 2**30)
    row["ratio"] = row["predicted_s"] / run.measured_s
    if free:
        t1 = time.perf_counter()
        try:
            pick = plan_cluster(build(run), run.devices, batch=(run.gbs, run.seq), hardware=run.hardware,
                                microbatch_sizes=(1, 2, 4), virtual_stages=(2,), time_budget_s=90, max_simulations=60)
        except InfeasiblePlanError as e:
            row["autoplan_pick"] = f"infeasible: {str(e)[:160]}"
            return row
        both = compare_plans({"published": plan, "autoplan": pick})
        p = pick.pipeline or {}
        row.update({"autoplan_pick": f"{both.loc['autoplan', 'mesh']} {pick.fsdp.get('mode')} "
                                     f"{plan_terms(pick)['recompute']} b{p.get('microbatch_size')} {p.get('schedule')}",
                    "autoplan_s": pick.predictions["step_s"], "claimed_speedup": plan.predictions["step_s"] /
                    pick.predictions["step_s"], "plan_s": time.perf_counter() - t1,
                    "speedup_terms": speedup_terms(plan, pick), "autoplan_mem_gib":
                    pick.predictions["memory_bytes"]["total"] / 2**30,
                    "mfu_note": next((n for n in pick.notes if "MFU" in n), "")})
    return row


def speedup_terms(published, pick) -> str:
    """Where the claimed speed-up comes from: each term of the step (busy compute + exposed TP / EP
    traffic, bubble, data-parallel + optimizer) of the published layout minus the pick's."""
    a, b = plan_terms(published), plan_terms(pick)
    return ", ".join(f"{k.removesuffix('_s')} {a[k]:.3g}->{b[k]:.3g}" for k in ("busy_s", "bubble_s",
                                                                              "dp_and_optimizer_s"))


AUTO_NOTE = ("autoplan's pick is priced for hyper_parallel's runtime (all-to-alls of every routed copy, exposed), "
             "the published layout for its source's runtime where the source states one (expert_runtime: DeepEP, "
             "DeepSeek-V3's): a claimed speed-up below 1 is then partly the price of our runtime.")


def write(df: pd.DataFrame) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT.with_suffix(".csv"), index=False, float_format="%.6g")
    ok = df.dropna(subset=["ratio"]) if "ratio" in df else df.iloc[:0]
    if "experts_as" in ok:   # a run whose experts could not be priced at its published ep is not its layout
        ok = ok[~ok.experts_as.fillna("").str.startswith("replicated:")]
    inside = (ok.ratio >= 0.85) & (ok.ratio <= 1.15)
    lg = ok.ratio.map(lambda r: abs(math.log2(r)))
    cols = [c for c in ["case", "source", "hardware", "devices", "published", "recompute", "m", "measured_s",
                        "predicted_s", "ratio", "experts_as", "busy_s", "bubble_s", "dp_and_optimizer_s",
                        "predicted_mem_gib", "error"] if c in df]
    lines = ["# Published MoE training runs: predicted vs measured step time", "", __doc__.split("\n\n")[1], "",
             "Regenerate with `PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_published_runs.py`.", "",
             f"**{int(inside.sum())} of {len(ok)}** runs priced at their published layout within 15 % "
             f"({len(df) - len(ok)} without a plan at it: see error / experts_as); "
             f"{int(((ok.ratio < 0.75) | (ok.ratio > 1.25)).sum())} outside 25 %; ratio range "
             f"{ok.ratio.min():.3f}-{ok.ratio.max():.3f}; median |log2(ratio)| "
             f"{statistics.median(lg) if len(lg) else float('nan'):.3f}. No constant is fitted to these runs: "
             "leaving a source out refits nothing, so the leave-one-source-out ratios are these.", "",
             df[cols].to_markdown(index=False, floatfmt=".4g"), ""]
    by = ok.assign(inside=inside).groupby("source").agg(cases=("case", "count"), within_15pct=("inside", "sum"),
                                                       median_ratio=("ratio", "median"))
    lines += ["Per source (leave-one-source-out):", "", by.reset_index().to_markdown(index=False, floatfmt=".3f"), ""]
    lines += ["## What each recipe states (priced as stated)", "",
              "Recomputation and pipeline cuts are taken from the source's recipe at the commit its summary was "
              "written from; where nothing is stated the fastest recompute mode and the planner's balanced cuts are "
              "taken.", ""]
    lines += [f"- {r.case}: recompute {STATED[r.case][0]}" + (f"; cuts: {STATED[r.case][1]}" if STATED[r.case][1] else "")
              for r in df.itertuples() if r.case in STATED]
    lines += ["", "## Their runtime, not ours", "",
              "What each published run's framework does that hyper_parallel's runtime does not (so a ratio > 1 is "
              "partly the price of our runtime, not an error of the model):", ""]
    lines += [f"- {r.case}: {r.their_runtime}" for r in df.itertuples() if r.their_runtime]
    if "mem_total_gib" in df:
        lines += memory_lines(df)
    if "autoplan_pick" in df:
        fc = [c for c in ["case", "published", "predicted_s", "autoplan_pick", "autoplan_s", "claimed_speedup",
                          "speedup_terms", "autoplan_mem_gib", "plan_s", "mfu_note"] if c in df]
        lines += ["", "## autoplan's own choice (same cost model)", "", AUTO_NOTE, "",
                  df[fc].to_markdown(index=False, floatfmt=".4g"), ""]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")


MEMORY_NOTE = (
    "Each run's plan at its published layout with the memory settings its source states (recompute, "
    "Megatron-Core recompute_modules, fused kernels' saved activations; citations below): "
    "`predictions.memory_bytes` of the plan `plan_cluster` returns -- the busiest pipeline rank's "
    "figure the search checked against the device (autoplan.search.experts.memory.memory_breakdown): "
    "parameters, gradients and optimizer state after TP, ep, FSDP / ZeRO-1 (the non-expert state over dp x "
    "ep, as every runtime here and hyper_parallel's shard it), the saved activations of the micro-batches "
    "the schedule holds in flight (`inflight` chunks). `fits`: total <= the profile's usable memory "
    "(`device_gib`). The params / grads / optimizer split is in the proportion one parameter byte has "
    "under the plan's dp mode (the total is exact).")


def memory_lines(df: pd.DataFrame) -> list[str]:
    m = df.dropna(subset=["mem_total_gib"]).copy()
    m["fits"] = m.mem_total_gib <= m.device_gib
    cols = ["case", "hardware", "published", "recompute", "recompute_modules", "mem_inflight", "mem_params_gib",
            "mem_grads_gib", "mem_optimizer_gib", "mem_activations_gib", "mem_total_gib",
            "device_gib", "fits"]
    out = ["", "## Memory at the published layout", "", MEMORY_NOTE, "",
           f"**{int(m.fits.sum())} of {len(m)}** published layouts fit their device's memory.", "",
           m[cols].rename(columns=lambda c: c.replace("mem_", "")).to_markdown(index=False, floatfmt=".1f"), "",
           "Memory settings, as each source states them:", ""]
    out += [f"- {r.case}: {r.memory_cite}" for r in m.itertuples() if r.memory_cite]
    return out


def committed_picks() -> pd.DataFrame | None:
    """autoplan's picks in the committed CSV, read once before this run overwrites it (the table is
    written after every run)."""
    old = OUT.with_suffix(".csv")
    if not old.exists():
        return None
    cols = ["autoplan_pick", "autoplan_s", "plan_s", "mfu_note", "speedup_terms", "autoplan_mem_gib"]
    prev = pd.read_csv(old)
    return prev[["case"] + [c for c in cols if c in prev]]


def keep_picks(df: pd.DataFrame, prev: pd.DataFrame | None) -> pd.DataFrame:
    """With --no-free: autoplan's picks from the committed CSV (the search is not rerun), their
    claimed speed-up against this run's price of the published layout."""
    if prev is None:
        return df
    out = df.merge(prev, on="case", how="left")
    if "autoplan_s" in out and "predicted_s" in out:
        out["claimed_speedup"] = out.predicted_s / out.autoplan_s
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-free", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    picks = committed_picks() if args.no_free else None
    rows = []
    for run in RUNS:
        if args.only and args.only not in run.name:
            continue
        row = price(run, not args.no_free)
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in ("their_runtime",)},
              flush=True)
        if not args.no_write and not args.only:
            write(keep_picks(pd.DataFrame(rows), picks) if args.no_free else pd.DataFrame(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
