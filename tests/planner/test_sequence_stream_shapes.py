"""Where the sequence sits for a sequence-sharded stream, read from the captured shapes: a block
that flattens its tokens (OPT) has them on dim 0 for its final norm and fc1/fc2; a norm between
the embedding and the first block (Bloom's) sees the whole sequence, so it is no final norm and the
stream is sharded at the first block. Both plans are checked against one device in the corpus
(benchmarks/model_corpus.py: OPT and Bloom forced_S EQUAL)."""
import torch
import transformers

from autoplan.capture import capture
from autoplan.search.strategies import mlp_strategies, norm_strategies
from autoplan.search.structure import model_structure
from hyper_parallel import Shard


def _structure(model):
    return model_structure(capture(model, batch=(2, 32), dtype=torch.float32))


def test_flattened_tokens_are_sharded_on_dim_0():
    cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                                 word_embed_proj_dim=64, vocab_size=128, max_position_embeddings=64)
    with torch.device("meta"):
        st = _structure(transformers.OPTForCausalLM(cfg))
    block = st.blocks[0]
    assert block.mlp.rel == "" and block.mlp.token_dim == 0, block.mlp
    assert block.norm_token_dims == {"final_layer_norm": 0}, block.norm_token_dims
    mlp = mlp_strategies(block.mlp, block, 2, "S", [])[0]
    assert all(s.input_layouts == Shard(0) for n, s in mlp.styles.items() if n in block.mlp.up), mlp.styles
    assert mlp.styles[block.mlp.down].output_layouts == Shard(0)
    norms = norm_strategies(block.norms, 2, "S", [], block.norm_token_dims)[0].styles
    assert norms["final_layer_norm"].sequence_dim == 0 and norms["self_attn_layer_norm"].sequence_dim == 1


def test_a_norm_before_the_first_block_is_no_final_norm():
    cfg = transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=128)
    with torch.device("meta"):
        st = _structure(transformers.BloomForCausalLM(cfg))
    assert st.final_norms == ["transformer.ln_f"], st.final_norms
    assert not st.embedding.shard_safe
