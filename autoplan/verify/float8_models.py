"""Small copies of HF Llama, Qwen3 and Mixtral whose every sharded GEMM dimension is a multiple of
16 at tp=4 -- the float8 GEMMs' requirement -- for checking float8 plans on CPU ranks.

The widths are the smallest that keep four heads and four KV heads of 32 (so q, k and v split
over four ranks into 32-wide shards), an MLP of 256 (64 per rank) and Mixtral's four experts with
top-2 routing; the vocabulary (the head stays in high precision) is small.
"""
from __future__ import annotations

from autoplan.verify.shrink import ModelRecipe

_COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(_COMMON, model_type="llama", model_class="LlamaForCausalLM"),
    "qwen3": dict(_COMMON, model_type="qwen3", model_class="Qwen3ForCausalLM", head_dim=32),
    "mixtral": dict(_COMMON, model_type="mixtral", model_class="MixtralForCausalLM", num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
}


def float8_recipe(family: str, seed: int = 5) -> ModelRecipe:
    """The small copy of ``family`` ("llama", "qwen3", "mixtral") as every rank rebuilds it."""
    if family not in FAMILIES:
        raise KeyError(f"float8_recipe: unknown family {family!r}; known: {sorted(FAMILIES)}")
    return ModelRecipe(hf_config=dict(FAMILIES[family]), seed=seed)
