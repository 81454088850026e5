"""Rank functions: context parallelism inside pipeline stages (pp=2 x cp=2 on 4 gloo ranks) --
one training step equals one device, every parameter perturbed."""
from __future__ import annotations

import torch

from hyper_parallel import apply_context_parallel, average_gradients, cp_cross_entropy, shard_batch
from hyper_parallel.core.pipeline_parallel import build_stages, schedule_facts
from hyper_parallel.core.pipeline_parallel.microbatch import NO_SPLIT
from hyper_parallel.local import cached_mesh
from tests.pipeline.workers import build_model, compare, data, lm_loss


def _qwen3():
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def _perturbed(kind: str, seed: int = 13):
    model = _qwen3() if kind == "qwen3" else build_model(kind, False, 2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def run_cp_pipeline(cases) -> list[dict]:
    """cases: (kind "titan" | "hf" | "qwen3", schedule name, n_microbatches, cp variant). The sequence is
    sharded over cp (head + tail chunks), the model cut over pp; the stages get the tokens' global
    positions as a step kwarg (RoPE rows for the repo Llama, position_ids for transformers)."""
    mesh = cached_mesh((2, 2), ("pp", "cp"))
    cp_mesh, pp_group = mesh["cp"], mesh["pp"].get_group()
    out = []
    for kind, name, m, variant in cases:
        x, y = data(4, 16)
        ref = _perturbed(kind)
        logits = ref(x)
        ref_loss = lm_loss(logits.logits if hasattr(logits, "logits") else logits, y)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
        model = _perturbed(kind)
        apply_context_parallel(model, mesh, cp_dim="cp", variant=variant)
        cls = schedule_facts(name).schedule_class
        ir = cls.ir(2, m)
        stages = build_stages(model, ir, group=pp_group)
        tok, tgt, pos = shard_batch(cp_mesh, x, y)
        kwargs = {"positions": pos[0]} if kind == "titan" else {"position_ids": pos}
        sched = cls(stages, m, lambda lg, t: cp_cross_entropy(lg, t, cp_mesh),
                    kwarg_specs={k: NO_SPLIT for k in kwargs})
        first = any(st.stage_index == 0 for st in stages)
        last = any(st.stage_index == ir.n_stages - 1 for st in stages)
        loss = sched.step(*((tok,) if first else ()), target=tgt if last else None, **kwargs)
        for st in stages:   # cp ranks hold the same parameters: average their gradients
            average_gradients(st.module, cp_mesh)
        res = compare(stages, ref_grads, loss if last else None, ref_loss)
        res.update(case=(kind, name, m, variant))
        out.append(res)
    return out
