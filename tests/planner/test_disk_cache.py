"""The planner's disk cache: a plan made with a warm cache is byte-identical to one made
with an empty cache; an entry is keyed so that another model, config or input never reads it; a
damaged entry is a miss; entries are written whole (temporary file + rename)."""
import pytest

from autoplan import disk_cache, plan_cluster
from autoplan.capture import capture
from autoplan.capture.graph_cache import graph_key
from autoplan.capture.inputs import resolve_inputs
from autoplan.presets import build_preset
from autoplan.search.pipeline import schedule_store, schedule_timing
from autoplan.search.pipeline import support as pipeline_support


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPLAN_DISK_CACHE", "1")
    schedule_store.clear()
    schedule_timing.compile_schedule.cache_clear()
    yield tmp_path / "planner"
    schedule_store.clear()
    schedule_timing.compile_schedule.cache_clear()


def _entries(root, kind):
    return sorted(p.name for p in (root / kind).rglob("*.bin")) if (root / kind).exists() else []


def _plan():
    model = build_preset("llama3-8b", num_layers=3, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=512)
    return plan_cluster(model, 4, batch=(8, 128), hardware="h100_sxm", devices_per_node=4,
                        microbatch_sizes=(1,), schedules=("1F1B", "ZBV")).to_json()


def test_warm_cache_plans_byte_identical(cache):
    cold = _plan()
    graphs, schedules = _entries(cache, "graphs"), _entries(cache, "schedules")
    assert graphs and schedules   # the first call filled both
    schedule_store.clear()
    schedule_timing.compile_schedule.cache_clear()
    assert _plan() == cold        # a later call (as a fresh process would) reads them
    assert _entries(cache, "graphs") == graphs


def test_pipeline_layout_is_read_back_for_the_same_model_only(cache, monkeypatch):
    """The pipeline guard's verdict and units (a trace of the whole forward and a small copy's run)
    are read from disk by a later process; another model computes its own."""
    def small(layers):
        return build_preset("llama3-8b", num_layers=layers, hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)

    first = pipeline_support.pipeline_layout(small(2))
    assert first[0] is None and first[1][-1] == "lm_head" and len(first[1]) == 5
    assert len(_entries(cache, "pipeline_layout")) == 1

    def computed(model):
        raise AssertionError("computed again")

    monkeypatch.setattr(pipeline_support, "pipeline_refusal", computed)
    assert pipeline_support.pipeline_layout(small(2)) == first
    with pytest.raises(AssertionError, match="computed again"):
        pipeline_support.pipeline_layout(small(3))


def test_key_names_model_config_and_inputs(cache):
    def key(model, batch):
        a, k = resolve_inputs(model, None, batch, None)
        return graph_key(model, a, k, dtype=None)

    base = build_preset("llama3-8b", num_layers=2)
    assert key(base, (1, 64)) == key(build_preset("llama3-8b", num_layers=2), (1, 64))
    assert key(base, (1, 64)) != key(base, (1, 128))
    assert key(base, (1, 64)) != key(build_preset("llama3-8b", num_layers=3), (1, 64))
    assert key(base, (1, 64)) != key(build_preset("llama3-8b", num_layers=2, max_position_embeddings=16384), (1, 64))
    other = build_preset("llama3-8b", num_layers=2)
    other.model.layers[0].self_attn.scaling = 0.5     # a plain attribute the forward reads
    assert key(base, (1, 64)) != key(other, (1, 64))


def test_damaged_entry_is_a_miss_and_rewritten(cache):
    model = build_preset("llama3-8b", num_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    first = capture(model, batch=(1, 32)).to_dict()
    (entry,) = list((cache / "graphs").rglob("*.bin"))
    entry.write_bytes(b"not a pickle")
    assert capture(model, batch=(1, 32)).to_dict() == first
    assert entry.read_bytes() != b"not a pickle"
    assert not list((cache / "graphs").rglob("*.tmp"))   # written through a renamed temporary file


def test_disabled_cache_writes_nothing(cache, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_DISK_CACHE", "0")
    disk_cache.store("x", "v", "k", b"data")
    assert disk_cache.load("x", "v", "k") is None and not cache.exists()
    monkeypatch.setenv("AUTOPLAN_DISK_CACHE", "1")
    disk_cache.store("x", "v", "k", b"data")
    assert disk_cache.load("x", "v", "k") == b"data" and disk_cache.load("x", "w", "k") is None


def test_any_project_source_change_moves_every_entry(monkeypatch):
    """An entry's version covers the whole source tree, not only the files its caller lists: a
    result depends on code beyond any list (stage code under a pipeline guard's verdict)."""
    from pathlib import Path

    listed = str(Path(pipeline_support.__file__))
    before = disk_cache.code_version(listed)
    probe = Path(disk_cache.__file__).resolve().parents[1] / "hyper_parallel" / "_disk_cache_probe_tmp.py"
    try:
        probe.write_text("# a source file no caller lists\n")
        disk_cache.source_tree.cache_clear()
        disk_cache.code_version.cache_clear()
        assert disk_cache.code_version(listed) != before
    finally:
        probe.unlink(missing_ok=True)
        disk_cache.source_tree.cache_clear()
        disk_cache.code_version.cache_clear()
    assert disk_cache.code_version(listed) == before
