"""Context parallelism prices each rank's K/V exchange from one head's width: read from capture,
or from the key projection's output over the KV heads -- which, for k and v fused in one [k|v]
projection, holds both (its width halves)."""
from types import SimpleNamespace

from autoplan.search.context.cost import _head_dim
from autoplan.search.units.structure import AttentionUnit


def _graph(width: int):
    return SimpleNamespace(modules={"layers.0.attn.kv_proj": SimpleNamespace(params={"weight": (width, 512)})})


def test_fused_kv_projection_counts_k_and_v_once_each():
    block = SimpleNamespace(representative="layers.0", dim=512)
    fused = AttentionUnit("attn", "attn.q_proj", "attn.kv_proj", "attn.kv_proj", "attn.o_proj", 8, 2, True)
    assert _head_dim(_graph(2 * 2 * 64), block, fused) == 64
    separate = AttentionUnit("attn", "attn.q_proj", "attn.kv_proj", "attn.v_proj", "attn.o_proj", 8, 2, True)
    assert _head_dim(_graph(2 * 64), block, separate) == 64
    captured = AttentionUnit("attn", "attn.q_proj", "attn.kv_proj", "attn.kv_proj", "attn.o_proj", 8, 2, True,
                             head_dim=96)
    assert _head_dim(_graph(2 * 2 * 64), block, captured) == 96
