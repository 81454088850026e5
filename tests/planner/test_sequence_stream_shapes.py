"""A norm between the embedding and the first block (Bloom's) sees the whole sequence, so it is no
final norm and the stream is sharded at the first block (checked against one device in the
corpus: benchmarks/model_corpus.py, Bloom forced_S EQUAL). OPT's flattened tokens (dim 0) are
tested with its other units in test_fused_units.py."""
import torch
import transformers

from autoplan.capture import capture
from autoplan.search.units.structure import model_structure


def test_a_norm_before_the_first_block_is_no_final_norm():
    cfg = transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=128)
    with torch.device("meta"):
        st = model_structure(capture(transformers.BloomForCausalLM(cfg), batch=(2, 32), dtype=torch.float32))
    assert st.final_norms == ["transformer.ln_f"], st.final_norms
    assert not st.embedding.shard_safe
