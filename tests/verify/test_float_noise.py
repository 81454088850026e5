"""check_numerics tells float32 rounding from a wrong gradient by a float64 run of the same step:
Nemotron's embedding gradient (values up to 1.3, summed over every position) differs from one
device by 2.5e-6 at tp=4 -- beyond ATOL_GRAD -- while one device's own float32 result is 4e-6 from
float64. A gradient off by more than twice that rounding is still wrong."""
import torch
import transformers

from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.verify.numerics import _beyond_float_noise
from autoplan.verify.shrink import recipe_for
from hyper_parallel.local import grads_by_name


def test_rounding_is_not_a_fault_and_a_fault_is():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    recipe = recipe_for(transformers.LlamaForCausalLM(config), [2], seed=3)
    ref = recipe.build()
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g)
    lm_loss(output_logits(forward_tokens(ref, tokens)), targets).backward()
    g_ref = grads_by_name(ref)
    exact = recipe.build().double()
    lm_loss(output_logits(forward_tokens(exact, tokens)), targets).backward()
    g64 = grads_by_name(exact)
    name = "model.embed_tokens.weight"
    noise = (g_ref[name].double() - g64[name]).abs().max()
    rounded = {name: (g64[name] - (g_ref[name].double() - g64[name])).float()}   # as far on the other side
    assert _beyond_float_noise([name], g_ref, rounded, recipe, tokens, targets) == []
    wrong = {name: g_ref[name] + 4 * noise.float() + 1e-5}
    assert _beyond_float_noise([name], g_ref, wrong, recipe, tokens, targets) == [name]
