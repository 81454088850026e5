"""The repo Llama's ops as cost_models' op specs: what ``autoplan profile`` times and the cost
model's accuracy benchmark prices.

One block is recorded on fake tensors (forward and backward, as a device would run them) and its
counts multiplied by the layer count; the ends (embedding, final norm, output, cross-entropy)
once. These are fixtures of autoplan's models, so they live here rather than in cost_models,
which sits below the planner and knows no model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoplan.models.llama import LlamaConfig, RMSNorm, TransformerBlock, rope_tables
from cost_models.ops import OpSpec, dedupe, default_dtype, fake_cpu, record_ops


def llama_block_ops(batch: int, seq: int, dtype: str = "float32", count: int = 1, backward: bool = True,
                    **config) -> list[OpSpec]:
    """Distinct ops of one block of autoplan.models.llama (forward and backward) at (batch, seq).

    ``config`` overrides LlamaConfig fields (dim, n_heads, n_kv_heads, ffn_hidden...). ``count``
    multiplies occurrences (the number of identical layers).
    """
    cfg = LlamaConfig(**{**config, "max_seq_len": max(seq, config.get("max_seq_len", seq))})
    dt = getattr(torch, dtype.split(".")[-1])
    with fake_cpu(), default_dtype(dt):
        block = TransformerBlock(cfg)
        x = torch.empty(batch, seq, cfg.dim, dtype=dt, requires_grad=True)
        rope = rope_tables(cfg.head_dim, seq, cfg.rope_theta).float()
        grad = torch.empty(batch, seq, cfg.dim, dtype=dt)
        return record_ops(lambda: block(x, rope), (lambda y: y.backward(grad)) if backward else None,
                          count=count)


def llama_model_ops(batch: int, seq: int, dtype: str = "float32", backward: bool = True,
                    **config) -> list[OpSpec]:
    """Distinct ops of a whole repo Llama (embedding, blocks, norm, output, cross-entropy loss).

    One block is recorded and its counts multiplied by n_layers: repeated blocks are traced once.
    """
    cfg = LlamaConfig(**{**config, "max_seq_len": max(seq, config.get("max_seq_len", seq))})
    block = llama_block_ops(batch, seq, dtype, count=cfg.n_layers, backward=backward, **config)
    dt = getattr(torch, dtype.split(".")[-1])
    fake_mode = fake_cpu()
    with fake_mode, default_dtype(dt):
        emb = torch.nn.Embedding(cfg.vocab_size, cfg.dim)
        norm = RMSNorm(cfg.dim)
        out = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        tokens = torch.zeros(batch, seq, dtype=torch.long)
        h_last = torch.empty(batch, seq, cfg.dim, dtype=dt, requires_grad=True)
        g_h0, g_loss = torch.empty(batch, seq, cfg.dim, dtype=dt), torch.ones(())

    def ends():
        h0 = emb(tokens)
        logits = out(norm(h_last))
        return h0, F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    def ends_bwd(res):
        torch.autograd.backward(list(res), [g_h0, g_loss])

    with fake_mode:
        rest = record_ops(ends, ends_bwd if backward else None)
    return dedupe(block + rest)
