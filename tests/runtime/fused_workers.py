"""Rank functions for tests/runtime/test_fused_styles.py: transformers' Conv1D and fused q/k/v
projections sharded column/row-wise, one step compared with one device; attention code that cuts
by the head counts it stores, made local by PrepareHeadsInput."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers.pytorch_utils import Conv1D

from hyper_parallel import ColwiseParallel, PrepareHeadsInput, Replicate, RowwiseParallel, parallelize_module
from hyper_parallel.core.dtensor import fsdp_shard_placement
from hyper_parallel.errors import LayoutError
from hyper_parallel.local import cached_mesh
from hyper_parallel.testing.compare import compare_steps

DIM, HEADS, VOCAB = 32, 8, 64


class Attention(nn.Module):
    """One fused q/k/v projection cut by the *local* head count: ``interleaved`` views the
    output as (heads, 3 * head_dim) (GPT-NeoX), ``concat`` chunks [q|k|v] in three (GPT-2-like)."""

    def __init__(self, layout: str, conv: bool):
        super().__init__()
        self.layout, self.hd = layout, DIM // HEADS
        self.qkv = Conv1D(3 * DIM, DIM) if conv else nn.Linear(DIM, 3 * DIM)
        self.o = Conv1D(DIM, DIM) if conv else nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)
        if self.layout == "interleaved":
            q, k, v = y.view(b, s, -1, 3 * self.hd).transpose(1, 2).chunk(3, dim=-1)
        else:
            q, k, v = (t.view(b, s, -1, self.hd).transpose(1, 2) for t in y.chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Config:
    """A config object shared by the model and its attention (as HF models share theirs)."""

    def __init__(self):
        self.n_heads = HEADS


class CountedAttention(nn.Module):
    """Phi-3's and StableLM's way: [q|k|v] sliced at ``config.n_heads * head_dim`` and each part
    viewed by ``self.n_heads`` -- global counts unless the style makes them local."""

    def __init__(self, config: Config, conv: bool):
        super().__init__()
        self.config, self.n_heads, self.hd = config, config.n_heads, DIM // HEADS
        self.qkv = Conv1D(3 * DIM, DIM) if conv else nn.Linear(DIM, 3 * DIM)
        self.o = Conv1D(DIM, DIM) if conv else nn.Linear(DIM, DIM)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)
        w = self.config.n_heads * self.hd
        q, k, v = (t.view(b, s, self.n_heads, self.hd).transpose(1, 2) for t in (y[..., :w], y[..., w:2 * w],
                                                                                   y[..., 2 * w:]))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))


class Model(nn.Module):
    def __init__(self, layout: str, conv: bool, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.config = Config()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.attn = CountedAttention(self.config, conv) if layout == "counted" else Attention(layout, conv)
        self.up = Conv1D(4 * DIM, DIM) if conv else nn.Linear(DIM, 4 * DIM)
        self.down = Conv1D(DIM, 4 * DIM) if conv else nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.1)   # Conv1D biases start at zero

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.attn(h)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def par_loss(model, tokens, target):
    loss = ce(model(tokens), target)
    loss.backward()
    return loss


def check_fused(cases: list[tuple[str, bool]]) -> dict:
    """Per (layout, conv): (ok, ref losses, par losses, grad mismatches, missing grads)."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
            for _ in range(2)]
    out = {}
    for layout, conv in cases:
        ref, par = Model(layout, conv), Model(layout, conv)
        plan = {"attn.qkv": ColwiseParallel(packed=1 if layout == "interleaved" else 3),
                "attn.o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
        if layout == "counted":
            plan["attn"] = PrepareHeadsInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                             local_attributes=["config.n_heads", "n_heads"])
        parallelize_module(par, mesh, plan)
        res = compare_steps(ref, par, data, ce, par_loss)
        local = layout != "counted" or (par.attn.n_heads == par.attn.config.n_heads == HEADS // mesh.size()
                                        and par.config.n_heads == HEADS and par.attn.config is not par.config)
        out[f"{layout}/conv={conv}"] = (res.ok and local, res.ref_losses, res.par_losses,
                                        res.grad_mismatches[:5], res.missing_grads[:5])
    return out


def check_fsdp_over_packed() -> dict:
    """dp=2 x tp=2: a bias-free packed [q|k|v] Linear and a packed-free rest, FSDP2 sharding the
    strided weight on its other dimension (fsdp_shard_placement). Two steps against one device,
    gradients compared through their global view (which FSDP2's default dim 0 scrambles); a
    packed projection with a bias is refused before anything is sharded."""
    mesh = cached_mesh((2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
            for _ in range(2)]
    ref, par = Model("concat", False), Model("concat", False)
    for m in (ref, par):
        m.attn.qkv.register_parameter("bias", None)
    plan = {"attn.qkv": ColwiseParallel(packed=3), "attn.o": RowwiseParallel(), "up": ColwiseParallel(),
            "down": RowwiseParallel()}
    parallelize_module(par, mesh, plan, mesh_dim="tp")
    fully_shard(par.attn, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    fully_shard(par, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
    res = compare_steps(ref, par, data, ce, par_loss)
    placements = {n: tuple(str(x) for x in p.placements) for n, p in par.named_parameters() if "qkv" in n}
    biased = Model("concat", False)
    parallelize_module(biased, mesh, plan, mesh_dim="tp")
    try:
        fully_shard(biased.attn, mesh=mesh["dp"], shard_placement_fn=fsdp_shard_placement)
        refused = ""
    except LayoutError as exc:
        refused = str(exc)
    return {"ok": res.ok, "losses": (res.ref_losses, res.par_losses), "bad": res.grad_mismatches[:4],
            "placements": placements, "refused": refused}
