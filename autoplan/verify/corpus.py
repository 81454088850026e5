"""The model corpus: the families a planner is judged on, each planned at its real shape and
checked on a small copy against one device.

A case is (family, mesh, variant). The family is planned at its published shape (two blocks per
stack: the per-block decision does not depend on depth) on H100 settings; the plan is then run
by :func:`~autoplan.verify.numerics.check_numerics` on a small copy of the same architecture.
Every case must end EQUAL (one training step equals one device) or REFUSED (autoplan raised a
typed error at planning time, naming the module and the reason). WRONG (a silently wrong
gradient or loss), CRASH (the plan fails to apply or step) and UNTYPED (planning failed with an
exception outside autoplan's hierarchy) are bugs.
"""
from __future__ import annotations

import logging
import math
import time
import traceback
from dataclasses import dataclass

import torch

from autoplan.api import autoplan
from autoplan.cluster import plan_cluster
from autoplan.capture import capture
from autoplan.errors import AutoplanError, CaptureError
from autoplan.models import build_llama
from hyper_parallel.parallel_dims import ParallelDims
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe, recipe_for

log = logging.getLogger(__name__)

# family -> (config class, model class, config overrides at the real shape)
HF_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 1600, "n_head": 25}),            # gpt2-xl: 25 heads
    "gpt2_medium": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 1024, "n_head": 16}),     # gpt2-medium
    # GPT-3 175B's shape in GPT-2's modules, vocabulary padded as Megatron pads it
    "gpt3": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 12288, "n_head": 96, "n_inner": 49152,
                                               "vocab_size": 51200, "n_positions": 2048}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True, "hidden_size": 8192,
                                                     "num_attention_heads": 128, "num_kv_heads": 8}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # a sliding window on every layer (Mistral-7B-v0.1's 4096; shrunk below the checked sequence)
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    # sliding windows on three layers of four, no RoPE on the global ones (pipelined
    # plans ran every layer without its window)
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {}),
    # per-layer-type masks and RoPE tables, scaled embedding inside its module
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    # LayerNorm1P, squared-ReLU MLP (Nemotron-4's shape with GQA)
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {"num_key_value_heads": 8}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}),
    "bert": ("BertConfig", "BertForMaskedLM", {"hidden_size": 1024, "num_attention_heads": 16,
                                               "intermediate_size": 4096}),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"d_model": 1024, "num_heads": 16, "d_ff": 4096}),
    "bart": ("BartConfig", "BartForConditionalGeneration", {}),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 4096, "n_head": 32}),            # bloom-7b1
    "opt": ("OPTConfig", "OPTForCausalLM", {"hidden_size": 4096, "num_attention_heads": 32,      # opt-6.7b
                                            "ffn_dim": 16384, "word_embed_proj_dim": 4096}),
    # DeepSeek-V3 (the config's defaults: MLA with q_lora_rank 1536): a dense block, then a MoE
    # block with 16 of its 256 routed experts (2 per routing group) -- all 256 replicated need 179 GiB per rank on 4
    # ranks, and these meshes have no ep dimension to spread them (REFUSED, as it should be)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"first_k_dense_replace": 1, "n_routed_experts": 16}),
    # DeepSeek-V2-Lite's shape in V3's modules: MLA with a plain q_proj (no q_lora_rank); both blocks
    # dense (its first block's kind; the MoE block is deepseek_v3's), so a sequence-sharded stream
    # can carry them
    "deepseek_v2_lite": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "first_k_dense_replace": 2, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "vocab_size": 102400}),
}
# families whose shapes the planner once left replicated, run at tp=4 and dp=2 x tp=2 only
SHAPE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    # StarCoder-1's shape: multi-query attention (one KV head) in a fused [q|k|v]
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {
        "n_embd": 6144, "n_head": 48, "n_inner": 24576, "n_positions": 8192, "multi_query": True,
        "vocab_size": 49152}),
    # OLMoE-1B-7B: 64 stacked experts, top-8, no shared expert
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {}),
    # DBRX: clamped fused Wqkv with GQA, 16 experts top-4 (clip_qkv as the released model)
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", {
        "d_model": 6144, "n_heads": 48, "max_seq_len": 32768, "vocab_size": 100352,
        "attn_config": {"kv_n_heads": 8, "rope_theta": 500000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}}),
    # Llama-4 Scout's text model: 16 routed experts top-1 beside a shared expert, every layer MoE
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {}),
    # JetMoE: mixture of attention heads and of MLP experts routed by data-dependent counts
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", {}),
    # Jamba: a Mamba layer with a dense MLP, then an attention layer with 16 experts, twice (four layers: each
    # kind repeats, so each forms a block group the planner solves; two layers of two classes form none)
    "jamba": ("JambaConfig", "JambaForCausalLM", {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
                                                  "expert_layer_period": 2, "expert_layer_offset": 1,
                                                  "use_mamba_kernels": False}),
    # Falcon-H1: attention and a Mamba-2 mixer in parallel in every block
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {}),
    # MPT-7B: fused Wqkv reshaped by the global head count, ALiBi
    "mpt": ("MptConfig", "MptForCausalLM", {"d_model": 4096, "n_heads": 32, "max_seq_len": 2048}),
    # Persimmon-8B: fused query_key_value with per-head layer norms of q and k
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", {}),
    # XGLM-564M: fc1/fc2 directly in the block, sinusoidal positions
    "xglm": ("XGLMConfig", "XGLMForCausalLM", {}),
    # GPT-OSS-20B: a learnable sink logit per attention head, sliding-window layers alternating with full
    # ones, 32 stacked experts with biases and a clamped GLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {}),
}
HF_FAMILIES.update(SHAPE_FAMILIES)
FAMILIES = ("llama",) + tuple(HF_FAMILIES)
MESHES = {"tp4": ((4,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp")),
          "pp2_tp2": ((2, 2), ("pp", "tp")), "pp2_dp2": ((2, 2), ("dp", "pp"))}
# pipelined cases: planned by plan_cluster with the degrees fixed (its search picks the schedule,
# micro-batches and cuts), in fp32 so the small copy's step compares exactly with one device
PIPELINED = {"pp2_tp2": {"pp": 2, "tp": 2, "dp": 1}, "pp2_dp2": {"pp": 2, "tp": 1, "dp": 2}}
VARIANTS = {
    "default": {},
    "forced_R": {"allow_replicated_units": False, "sequence_parallel": False},
    "forced_S": {"allow_replicated_units": False, "sequence_parallel": True},
}
SEQ = 2048                      # planning sequence length (real shape)
LLAMA_REAL = dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336,
                  max_seq_len=SEQ)
LLAMA_SMALL = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=64)


def real_model(family: str) -> torch.nn.Module:
    """The family at its published shape with two blocks per stack, on meta."""
    if family == "llama":
        return build_llama(device="meta", **LLAMA_REAL)
    import transformers

    cfg_name, model_name, overrides = HF_FAMILIES[family]
    cfg_cls = getattr(transformers, cfg_name)
    layers = {"GPT2Config": {"n_layer": 2}, "T5Config": {"num_layers": 2, "num_decoder_layers": 2},
              "BartConfig": {"encoder_layers": 2, "decoder_layers": 2},
              "BloomConfig": {"n_layer": 2}, "DbrxConfig": {"n_layers": 2}, "MptConfig": {"n_layers": 2},
              "XGLMConfig": {"num_layers": 2}}.get(cfg_name, {"num_hidden_layers": 2})
    config = cfg_cls(**{**layers, **overrides})
    with torch.device("meta"):
        return getattr(transformers, model_name)(config)


# Jamba's Mamba mixer runs its selective scan token by token without the CUDA kernels: a capture
# traces one step per token, so it is planned at a shorter sequence
SHORT_SEQ = {"JambaForCausalLM": 256}


def seq_len(model: torch.nn.Module) -> int:
    """SEQ, or the model's position limit when shorter (BERT: 512)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or SEQ
    return min(SEQ, int(limit), SHORT_SEQ.get(type(model).__name__, SEQ))


def small_recipe(family: str, model: torch.nn.Module, degrees: list[int]) -> ModelRecipe:
    if family == "llama":
        return ModelRecipe(factory="autoplan.models:build_llama", kwargs=dict(LLAMA_SMALL, seed=3), seed=3)
    recipe = recipe_for(model, degrees, seed=3)
    layers = HF_FAMILIES[family][2].get("num_hidden_layers")
    if layers and recipe.hf_config:   # a layer count the entry sets (Jamba's four: each kind twice) is kept
        recipe.hf_config["num_hidden_layers"] = layers
    return recipe


@dataclass
class CaseResult:
    family: str
    mesh: str
    variant: str
    outcome: str                 # EQUAL | REFUSED | WRONG | CRASH | UNTYPED
    sharded: str                 # units sharded by the plan (strategy names)
    stream: str
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outcome in ("EQUAL", "REFUSED")


_CAPTURED: dict[str, tuple] = {}   # family -> (model, graph): every case plans (4 sequences, SEQ) per dp rank


def plan_case(family: str, mesh: str, variant: str):
    shape, names = MESHES[mesh]
    dp = dict(zip(names, shape)).get("dp", 1)
    if family not in _CAPTURED:
        model = real_model(family)
        _CAPTURED.clear()
        try:
            graph = capture(model, batch=(4, seq_len(model)), dtype=torch.bfloat16)
        except CaptureError:   # autoplan captures again and plans it data-parallel only
            graph = None
        _CAPTURED[family] = (model, graph)
    model, graph = _CAPTURED[family]
    if mesh in PIPELINED:
        plan = plan_cluster(model, math.prod(shape), hardware="h100_sxm", batch=(8, seq_len(model)),
                            constraints=PIPELINED[mesh], dtype=torch.float32, **VARIANTS[variant])
        return model, plan
    plan = autoplan(model, ParallelDims(shape, names, "h100_sxm"), batch=(4 * dp, seq_len(model)), graph=graph,
                    **VARIANTS[variant])
    return model, plan


def sharded_units(plan) -> str:
    units = sorted({f"{d['unit'].split('/')[-1]}:{d['strategy']}" for d in plan.decisions
                    if d["strategy"] not in ("replicate", "none")})
    return ", ".join(units) or "-"


def run_case(family: str, mesh: str, variant: str, pool=None) -> CaseResult:
    t0 = time.perf_counter()
    try:
        model, plan = plan_case(family, mesh, variant)
    except AutoplanError as exc:
        return CaseResult(family, mesh, variant, "REFUSED", "-", "-", f"{type(exc).__name__}: {exc}",
                          time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the corpus reports it
        log.debug("%s", traceback.format_exc())
        return CaseResult(family, mesh, variant, "UNTYPED", "-", "-", f"{type(exc).__name__}: {exc}"[:300],
                          time.perf_counter() - t0)
    degrees = [d for d in plan.mesh["shape"] if d > 1]
    pipe = plan.pipeline or {}
    # one sequence per micro-batch and dp rank: the plan's micro-batch count divides the rows
    rows = PIPELINED[mesh]["dp"] * int(pipe.get("microbatches", 1)) if mesh in PIPELINED else None
    try:
        recipe = small_recipe(family, model, degrees)
    except AutoplanError as exc:   # no small copy to check the plan on: the check, not the plan, failed
        return CaseResult(family, mesh, variant, "CRASH", sharded_units(plan), plan.stream_layout,
                          f"no small copy: {type(exc).__name__}: {exc}"[:300], time.perf_counter() - t0)
    result = check_numerics(plan, recipe, pool=pool, global_batch=rows)
    outcome = "EQUAL" if result.passed else ("CRASH" if result.error else "WRONG")
    return CaseResult(family, mesh, variant, outcome, sharded_units(plan), plan.stream_layout,
                      result.summary()[:300], time.perf_counter() - t0)


def all_cases(families=FAMILIES, meshes=tuple(MESHES), variants=tuple(VARIANTS)):
    return [(f, m, v) for f in families for m in meshes for v in variants
            if f not in SHAPE_FAMILIES or m in ("tp4", "dp2_tp2")]


def world_of(mesh: str) -> int:
    return math.prod(MESHES[mesh][0])
