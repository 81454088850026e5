"""A tiny vision-language model written in the repo: a ViT tower in front of the repo's Llama.

Why it exists: MPipe (hyper_parallel.core.pipeline_parallel.mpipe) spreads a heavy "preprocess"
tower over the pipeline ranks, and its tests need a model whose tower is a separate module with a
tensor -- or a tuple -- output that the decoder consumes at image-token positions, like
Qwen2.5-VL / Qwen3-VL, but small enough for gloo on CPU.

- ``visual`` (:class:`VisionTower`): patch embedding (a Linear over flattened patches), ViT blocks
  shaped like HF's (``attn.q_proj/k_proj/v_proj/o_proj``, ``mlp.fc1/fc2``, LayerNorms), and a
  ``merger`` projecting to the decoder width. ``forward(pixel_values) -> image embeddings`` of
  shape (batch, n_patches, dim); with ``deepstack_levels=k`` a tuple (embeddings, level_1..level_k)
  of intermediate features (Qwen3-VL's DeepStack) that the decoder adds to the hidden state at
  image positions after layers 0..k-1. ``deepstack_grad=False`` detaches the levels: a tuple
  element that needs no gradient.
- the decoder: the repo Llama's units (``tok_embeddings``, ``layers.N``, ``norm``, ``output``,
  ``rope``); image tokens (id ``image_token_id``) are replaced by the image embeddings in order,
  ``n_patches`` of them per sequence.

``forward(tokens, pixel_values)`` is the one-device reference; the pipeline runs the decoder units
through the "vision-language" spine of split.py, the tower through MPipe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class VisionConfig:
    patch_dim: int = 12        # channels * patch_h * patch_w, flattened
    width: int = 16
    n_layers: int = 2
    n_heads: int = 2
    mlp_hidden: int = 32
    deepstack_levels: int = 0  # > 0: the tower returns a tuple (embeddings, level_1, ..., level_k)
    deepstack_grad: bool = True  # False: the levels are detached (a tuple element without gradient)


class VisionAttention(nn.Module):
    """Bidirectional attention over patches; local heads from the projected width (TP-friendly)."""

    def __init__(self, width: int, n_heads: int):
        super().__init__()
        self.head_dim = width // n_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class VisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attn = VisionAttention(cfg.width, cfg.n_heads)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = VisionMLP(cfg.width, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """pixel_values (batch, n_patches, patch_dim) -> embeddings (batch, n_patches, dim) [+ levels]."""

    def __init__(self, cfg: VisionConfig, out_dim: int):
        super().__init__()
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.width)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.n_layers))
        self.merger = nn.Linear(cfg.width, out_dim)
        self.deepstack = nn.ModuleList(nn.Linear(cfg.width, out_dim) for _ in range(cfg.deepstack_levels))

    def forward(self, pixel_values: torch.Tensor):
        x = self.patch_embed(pixel_values)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.deepstack):
                lvl = self.deepstack[i](x)
                levels.append(lvl if self.config.deepstack_grad else lvl.detach())
        emb = self.merger(x)
        return (emb, *levels) if self.deepstack else emb


class ImageMerge(nn.Module):
    """Where image features enter the decoder (no parameters). A module, not a function, so that
    pipeline stages carry it (split.py's vision-language spine calls ``merge`` and ``add_level``)."""

    def __init__(self, image_token_id: int):
        super().__init__()
        self.image_token_id = image_token_id

    def merge(self, h: torch.Tensor, tokens: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """``h`` with the rows at image tokens replaced by ``image`` rows, in order (HF's masked_scatter)."""
        mask = (tokens == self.image_token_id).unsqueeze(-1).expand_as(h)
        return h.masked_scatter(mask, image.to(h.dtype))

    def add_level(self, h: torch.Tensor, tokens: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """DeepStack: add a feature level to the hidden state at the image-token rows."""
        mask = (tokens == self.image_token_id).unsqueeze(-1).expand_as(h)
        return h + torch.zeros_like(h).masked_scatter(mask, level.to(h.dtype))


class VisionLanguageModel(Llama):
    """The repo Llama with a ``visual`` tower; ``forward(tokens, pixel_values) -> logits``."""

    def __init__(self, cfg: LlamaConfig, vision: VisionConfig, image_token_id: int = 0, n_patches: int = 4):
        super().__init__(cfg)
        self.image_token_id = image_token_id
        self.n_patches = n_patches
        self.image_merge = ImageMerge(image_token_id)
        self.visual = VisionTower(vision, cfg.dim)
        if vision.deepstack_levels > cfg.n_layers:
            raise ValueError(f"VisionLanguageModel: deepstack_levels={vision.deepstack_levels} exceeds "
                             f"n_layers={cfg.n_layers}; valid: 0..{cfg.n_layers}")

    def decode(self, tokens: torch.Tensor, vision) -> torch.Tensor:
        """The decoder given the tower's output (a tensor or a tuple with DeepStack levels)."""
        emb, *levels = vision if isinstance(vision, (tuple, list)) else (vision,)
        h = self.image_merge.merge(self.tok_embeddings(tokens), tokens, emb)
        rope = self.rope[:tokens.shape[1]]
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rope)
            if i < len(levels):
                h = self.image_merge.add_level(h, tokens, levels[i])
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.decode(tokens, self.visual(pixel_values))

    def extra_inputs(self, tokens: torch.Tensor) -> dict:
        """Images for token ids (the planner's probes run the model from tokens alone): one
        image of ``n_patches`` patches per sequence; on fake/meta tensors only shapes matter."""
        dtype = self.visual.patch_embed.weight.dtype
        return {"pixel_values": torch.zeros(tokens.shape[0], self.n_patches, self.visual.config.patch_dim,
                                            dtype=dtype, device=tokens.device)}


def build_vision_language(seed: int = 0, deepstack_levels: int = 0, deepstack_grad: bool = True,
                          n_layers: int = 4, n_patches: int = 4, vision: dict | None = None,
                          **overrides) -> VisionLanguageModel:
    """A tiny VL model (random weights, every parameter drawn from ``seed``); ``vision``: VisionConfig
    fields (e.g. ``{"n_layers": 4, "width": 64}`` for a tower heavy enough that MPipe pays)."""
    cfg = LlamaConfig(**{"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96,
                         "ffn_hidden": 64, "max_seq_len": 32, **overrides})
    vcfg = VisionConfig(**{"deepstack_levels": deepstack_levels, "deepstack_grad": deepstack_grad, **(vision or {})})
    model = VisionLanguageModel(cfg, vcfg, n_patches=n_patches)
    model.init_weights(seed)
    return model


def vl_batch(model: VisionLanguageModel, batch: int, seq: int, seed: int = 1):
    """(tokens, pixel_values, targets): ``n_patches`` image tokens at positions 1.. of each sequence."""
    g = torch.Generator().manual_seed(seed)
    n = model.n_patches
    tokens = torch.randint(1, model.config.vocab_size, (batch, seq), generator=g)
    tokens[:, 1:1 + n] = model.image_token_id
    pixels = torch.randn(batch, n, model.visual.config.patch_dim, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return tokens, pixels, targets
