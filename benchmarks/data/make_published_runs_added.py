"""Writes benchmarks/data/published_runs_added.json: published dense training runs beyond the shared
reference (shared/reference/published_runs.json), each with its source (paper / report, table), the
layout as published and the measured step time or throughput. Same schema as the reference.
Parameters are those of the shape as the repo builds it (checked by benchmarks/published_runs.py).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/data/make_published_runs_added.py
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("published_runs_added.json")
MEGATRON = ["1F1B", "Interleaved1F1B"]


def gpt(layers, hidden, heads, ffn, vocab, tied=True):
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=ffn, vocab=vocab, tied=tied,
                mlp="gelu", norm="layernorm", params=None)


def llama(layers, hidden, heads, kv, ffn, vocab, tied=False):
    return dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, tied=tied,
                mlp="swiglu", norm="rmsnorm", params=None)


def layout(dp, pp, tp, cp=1, recompute=None, sharding=None, sp=None, mbs=None, sched=None, v=None):
    return dict(dp=dp, pp=pp, tp=tp, cp=cp, schedule=sched, virtual_stages=v, microbatch_size=mbs,
                recompute=recompute, dp_sharding=sharding, sequence_parallel=sp,
                schedule_candidates=None if sched else MEGATRON)


def case(name, source, framework, model, hw, devices, gb, seq, lay, measure, value, formula, mfu_formula,
         notes=(), confidence="medium"):
    return dict(name=name, split="added", source=source, framework=framework, model=model, hardware=hw,
                devices=devices, global_batch=gb, seq_len=seq, layout=lay,
                achieved=dict(measure=measure, value=value, flops_formula=formula, model_flops_formula=mfu_formula),
                confidence=confidence, notes=list(notes))


MTNLG = gpt(105, 20480, 128, 81920, 51200)
MTNLG_SRC = ("Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B (arXiv 2201.11990), "
             "sec. 2.4: global batch 1920 on {n} DGX A100 nodes, TP 8 x PP 35, iteration {t} s ({tf} TFLOP/s/GPU)")
LLAMA405 = llama(126, 16384, 128, 8, 53248, 128256)
LLAMA_SRC = ("Llama Team, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 405B on {n} H100, TP {tp} CP {cp} "
             "PP {pp} DP {dp}, seq {s}, 16M tokens per batch, {tf} TFLOPs/GPU (BF16 MFU {mfu} %)")
NEMO340 = llama(96, 18432, 96, 8, 49152, 256000)   # squared-ReLU MLP of 73728 (2 matrices) = 3 x 49152
NEMO_SRC = ("NVIDIA, Nemotron-4 340B Technical Report (arXiv 2406.11704), Table 2: {n} H100 (DP {dp} x TP 8 x PP 12, "
            "interleaved), batch {b} x 4096 tokens, iteration {t} s, MFU {mfu} %")

CASES = [
    *[case(f"mtnlg-530B-{n * 8}", MTNLG_SRC.format(n=n, t=t, tf=tf), "Megatron-DeepSpeed (2021)", MTNLG, "a100_80gb",
           n * 8, 1920, 2048, layout(n * 8 // 280, 35, 8, recompute="full", sp=False), "step_s", t, None,
           "megatron_model_72",
           ["Selene DGX A100 80GB, HDR InfiniBand (8 x 200 Gb/s per node)",
            "data-parallel sharding and schedule not stated: left to the search; vocab 50,272 padded to 51,200 as "
            "Megatron pads for TP 8", "TFLOP/s published count the full-recompute forward (96 formula)"], "high")
      for n, t, tf in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))],
    case("bloom-176B-384", "BigScience Workshop, BLOOM (arXiv 2211.05100) sec. 3.4 and the BigScience 176B model "
         "card: 384 A100 80GB (48 nodes), TP 4 x PP 12 x DP 8, ZeRO stage 1, bf16, global batch 2048 x 2048, "
         "'training throughput: about 150 TFLOPs'", "Megatron-DeepSpeed (2022)",
         gpt(70, 14336, 112, 57344, 250880), "a100_80gb", 384, 2048, 2048,
         layout(8, 12, 4, recompute="full", sharding="zero1", sp=False), "tflops_per_gpu", 150.0, "megatron_hw_96",
         "megatron_model_72",
         ["Jean Zay: 4 Omni-Path 100 Gb/s links per node (half the per-GPU injection bandwidth of a DGX A100); "
          "priced on a100_80gb", "ALiBi and an embedding LayerNorm not modelled (negligible FLOPs)",
          "'about 150' is a rounded figure"], "low"),
    *[case(f"llama3-405B-{n}" + ("-cp16" if cp > 1 else ""),
           LLAMA_SRC.format(n=n, tp=8, cp=cp, pp=16, dp=dp, s=s, tf=tf, mfu=mfu), "Meta internal (4D parallelism, 2024)",
           LLAMA405, "h100_sxm", n, 16 * 2**20 // s, s,
           layout(dp, 16, 8, cp=cp, sharding="zero1", sp=True), "tflops_per_gpu", float(tf), "titan_6N_12Lhs",
           "titan_6N_12Lhs",
           ["H100 SXM 80GB HBM3 at 700 W, RoCE 400 Gb/s per GPU", "parameters not resharded after forward "
            "(ZeRO-2-like): priced as zero1 (optimizer state sharded, parameters replicated)",
            "TFLOPs under 6N + 12Lhs per token (the paper's exact FLOP count is not stated)",
            "schedule: their tuned interleaved 1F1B; virtual stages and micro-batch size left to the search"])
      # the third row of Table 4 (CP 16 at 131,072 tokens) is left out: the search prices no cp with pp
      for n, dp, cp, s, tf, mfu in ((8192, 64, 1, 8192, 430, 43), (16384, 128, 1, 8192, 400, 41))],
    *[case(f"nemotron4-340B-{n}", NEMO_SRC.format(n=n, dp=dp, b=b, t=t, mfu=mfu), "NeMo / Megatron-Core (2024)",
           NEMO340, "h100_sxm", n, b, 4096, layout(dp, 12, 8, sharding="zero1", sp=True), "step_s", t, None,
           "titan_6N_12Lhs",
           ["DGX H100, 8 x 400 Gb/s InfiniBand per node", "squared-ReLU MLP (2 x 18432 x 73728) built as a SwiGLU of "
            "3 x 18432 x 49152: same parameters and FLOPs", "recompute, virtual stages and micro-batch size not stated: "
            "left to the search"], "high")
      for n, dp, b, t, mfu in ((1536, 16, 768, 10.3, 42.4), (3072, 32, 1536, 10.3, 42.3), (6144, 64, 2304, 8.0, 41.0))],
]


TITAN_SRC = ("pytorch/torchtitan docs/performance.md: {m} with FSDP2 on 64 A100 80GB, local batch {b}, activation "
             "checkpointing '{ac}': {wps} WPS (tokens/s per GPU), MFU {mfu} %")
LLAMA3_8B, LLAMA3_70B = llama(32, 4096, 32, 8, 14336, 128256), llama(80, 8192, 64, 8, 28672, 128256)
LLAMA2_13B, LLAMA2_70B = llama(40, 5120, 40, 40, 13824, 32000), llama(80, 8192, 64, 8, 28672, 32000)
# torchtitan's "selective op" AC saves the matmul outputs and recomputes the rest: priced as "selective";
# "selective layer" rows (every other block fully recomputed) have no mode here and are left out
CASES += [case(f"titanA100-{tag}", TITAN_SRC.format(m=m, b=b, ac=ac, wps=wps, mfu=mfu), "torchtitan (2024)", model,
               "a100_80gb", 64, 64 * b, seq, layout(64, 1, 1, recompute=rc, sharding="fsdp", mbs=b), "tokens_per_s_per_gpu",
               wps, None, "titan_6N_12Lhs", ["A100 80GB, 8 nodes; interconnect not stated (priced as DGX A100)",
                                              "torch.compile not used in these rows (2024 docs)"])
          for tag, m, model, seq, b, ac, rc, wps, mfu in (
              ("llama3-8B-sac-op", "Llama 3 8B", LLAMA3_8B, 8192, 1, "selective op", "selective", 2973, 58.2),
              ("llama3-70B-full", "Llama 3 70B", LLAMA3_70B, 8192, 1, "full", "full", 331, 51.7),
              ("llama2-13B-none", "Llama 2 13B", LLAMA2_13B, 4096, 2, "no", "none", 2162, 61.1),
              ("llama2-13B-sac-op", "Llama 2 13B", LLAMA2_13B, 4096, 2, "selective op", "selective", 1904, 53.8),
              ("llama2-70B-sac-op", "Llama 2 70B", LLAMA2_70B, 4096, 1, "selective op", "selective", 355, 50.8),
              ("llama2-70B-full", "Llama 2 70B", LLAMA2_70B, 4096, 2, "full", "full", 353, 50.5))]


def main() -> None:
    OUT.write_text(json.dumps({"_meta": {"description": __doc__.split("\n\n")[0],
                                         "schema": "shared/reference/published_runs.json _meta"},
                               "cases": CASES}, indent=1) + "\n")
    print(f"wrote {len(CASES)} cases to {OUT}")


if __name__ == "__main__":
    main()
