"""fqn_matches: one compiled matcher for plan keys, equal to atom-by-atom fnmatch."""
from fnmatch import fnmatchcase

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.fqn_pattern import fqn_matches, wildcards


def atomwise(pattern: str, fqn: str) -> bool:
    if pattern == "" or fqn == "":
        return pattern == fqn
    a, b = pattern.split("."), fqn.split(".")
    return len(a) == len(b) and all(fnmatchcase(y, x) for x, y in zip(a, b))


NAMES = st.sampled_from(["model", "layers", "0", "1", "12", "mlp", "attn", "q_proj", "h", "a.b"])
ATOMS = st.sampled_from(["*", "?", "1*", "[0-3]", "[!0-3]", "q_*", "mlp", "layers", "a?c", "model"])


@settings(max_examples=300, deadline=None)
@given(st.lists(ATOMS | NAMES, min_size=1, max_size=4), st.lists(NAMES, min_size=1, max_size=4))
def test_equals_atomwise_fnmatch(pattern_atoms, fqn_atoms):
    pattern, fqn = ".".join(pattern_atoms), ".".join(fqn_atoms)
    assert fqn_matches(pattern, fqn) == atomwise(pattern, fqn), (pattern, fqn)


def test_star_never_crosses_a_dot_and_root_is_only_empty():
    assert fqn_matches("model.layers.*.mlp", "model.layers.3.mlp")
    assert not fqn_matches("model.*.mlp", "model.layers.3.mlp")
    assert not fqn_matches("*", "model.layers") and fqn_matches("*", "model")
    assert fqn_matches("", "") and not fqn_matches("", "model") and not fqn_matches("*", "")
    assert wildcards("model.layers.*.q_[kv]") == 2 and wildcards("model.norm") == 0
