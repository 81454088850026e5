"""Block groups sharing a container: the large group's ``prefix.*`` patterns must not reach a module
of the small group that the small group leaves unstyled (DeepSeek-V3: dense layers 0-2 beside MoE
layers 3-60)."""
from types import SimpleNamespace

from autoplan.search.tp.group_patterns import seal_group_wildcards, wildcard_group

COL = {"style": "ColwiseParallel", "args": {}}
ROW = {"style": "RowwiseParallel", "args": {}}


def _blocks():
    dense = SimpleNamespace(prefix="model.layers", indices=["0", "1"], count=2)
    moe = SimpleNamespace(prefix="model.layers", indices=["2", "3", "4"], count=3)
    return [dense, moe]


def _modules():
    mods = {"model", "model.layers"}
    for i in range(5):
        mods |= {f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.self_attn.q_proj",
                 f"model.layers.{i}.mlp"}
    return mods


def test_the_largest_group_owns_the_wildcard():
    dense, moe = _blocks()
    assert wildcard_group([dense, moe], "model.layers") is moe


def test_a_pattern_reaching_an_unstyled_module_of_another_group_is_named_per_member():
    styles = {"model.layers.*.self_attn.q_proj": COL, "model.layers.*.mlp": ROW,
              "model.layers.0.mlp": COL, "model.layers.1.mlp": COL}
    out = seal_group_wildcards(styles, _blocks(), _modules())
    # the dense layers style their own mlp: the wildcard may stay (the specific patterns win there)
    assert out["model.layers.*.mlp"] == ROW
    # the dense layers leave q_proj unstyled: the wildcard would have sharded it there
    assert "model.layers.*.self_attn.q_proj" not in out
    assert {k for k in out if k.endswith("q_proj")} == {f"model.layers.{i}.self_attn.q_proj" for i in (2, 3, 4)}


def test_one_group_per_container_keeps_its_wildcard():
    blocks = [SimpleNamespace(prefix="model.layers", indices=[str(i) for i in range(5)], count=5)]
    styles = {"model.layers.*.self_attn.q_proj": COL}
    assert seal_group_wildcards(styles, blocks, _modules()) == styles
