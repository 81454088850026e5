"""A sequence-sharded stream around a unit that needs the whole sequence (GatheredRegion) and
per-token linears on flattened tokens (the sequence on dim 0): equal to one device."""
import pytest

from hyper_parallel.core.style_registry import style_from_dict
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion
from hyper_parallel.errors import StyleSpecError
from tests.runtime import sequence_region_workers


def test_gathered_region_and_flattened_tokens_match_one_device(pool4):
    for rank, (ok, ref, par, bad, missing) in enumerate(pool4.run(sequence_region_workers.check_gathered_region)):
        assert ok, (rank, ref, par, bad, missing)


def test_gathered_region_round_trips_and_checks_its_argument():
    style = GatheredRegion(sequence_dim=0)
    assert style_from_dict(style.to_dict()) == style
    with pytest.raises(StyleSpecError, match="sequence_dim"):
        GatheredRegion(sequence_dim=-1)


def test_gathered_region_with_local_attributes_round_trips_and_checks_them():
    """A region that also makes a module's head counts local (JetMoE's mixture of attention heads
    on a sequence-sharded stream) names attribute paths, validated as PrepareHeadsInput's are."""
    style = GatheredRegion(sequence_dim=1, local_attributes=["num_heads", "config.num_attention_heads"])
    assert style.local_attributes == ["config.num_attention_heads", "num_heads"]
    assert style_from_dict(style.to_dict()) == style
    assert "local_attributes" not in GatheredRegion().to_dict().get("args", {})
    with pytest.raises(StyleSpecError, match="attribute path"):
        GatheredRegion(local_attributes=["a.b.c"])
    with pytest.raises(StyleSpecError, match="non-empty list"):
        GatheredRegion(local_attributes=[])
