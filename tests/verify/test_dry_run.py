"""Predicted collectives and parameter bytes equal what the runtime issues, at real world sizes."""
import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.models import build_llama
from autoplan.verify import verify
from tests.planner.e2e_workers import build

F32 = torch.float32


def _llama(**kw):
    cfg = dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=1000, ffn_hidden=520, max_seq_len=256)
    cfg.update(kw)
    return build_llama(device="meta", **cfg)


# (id, model factory, mesh shape, names, global batch, seq, planner options)
CASES = [
    ("tp8_sp_loss_parallel", _llama, (8,), ("tp",), 2, 128, dict(sequence_parallel=True)),
    ("tp8_megatron", _llama, (8,), ("tp",), 2, 128, dict(sequence_parallel=False)),
    ("dp3_tp2_uneven_fsdp", _llama, (3, 2), ("dp", "tp"), 6, 128, dict(sequence_parallel=False)),
    ("dp4_tp2_replicated_dp", _llama, (4, 2), ("dp", "tp"), 8, 128, dict(sequence_parallel=True, fsdp=False)),
    ("dp4_tp8_sp_fsdp", _llama, (4, 8), ("dp", "tp"), 8, 128, dict(sequence_parallel=True)),
    ("tied_tp4_sp", lambda: _llama(tie_embeddings=True, dim=128, n_heads=4, n_kv_heads=4), (4,), ("tp",), 2, 64,
     dict(sequence_parallel=True)),
    ("kv_replicated_tp8", lambda: _llama(n_kv_heads=2), (2, 8), ("dp", "tp"), 4, 128, dict()),
    ("hf_llama_dp2_tp2", lambda: build("hf_llama", device="meta"), (2, 2), ("dp", "tp"), 4, 16,
     dict(sequence_parallel=True)),
    ("hf_qwen2_tp4", lambda: build("hf_qwen2", device="meta"), (4,), ("tp",), 2, 16, dict(sequence_parallel=False)),
    ("bf16_checkpointed_dp2_tp4", _llama, (2, 4), ("dp", "tp"), 4, 128,
     dict(sequence_parallel=True, activation_checkpointing=True, dtype=torch.bfloat16)),
    ("world512_dp64_tp8", lambda: _llama(dim=512, n_heads=8, n_kv_heads=8, vocab_size=4096, ffn_hidden=1024),
     (64, 8), ("dp", "tp"), 64, 256, dict(sequence_parallel=True)),
]


@pytest.mark.parametrize("name,make,shape,names,gb,seq,opts", CASES, ids=[c[0] for c in CASES])
def test_predicted_equals_issued(name, make, shape, names, gb, seq, opts):
    model = make()
    opts = dict(opts)
    dtype = opts.pop("dtype", F32)
    plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(gb, seq), dtype=dtype,
                    allow_replicated_units="kv_replicated" in name, **opts)
    assert plan.activation_checkpointing == bool(opts.get("activation_checkpointing"))
    result = verify(plan, model)
    assert result.param_bytes["predicted"] == result.param_bytes["issued"], (name, result.param_bytes)
    assert result.passed, f"{name}: mismatches\n{result.mismatches().to_string()}"
    assert (result.collectives["issued"] > 0).any(), name
    if opts.get("sequence_parallel"):
        assert {"all_gather", "reduce_scatter"} <= set(result.collectives["kind"])
    if plan.loss_parallel:
        assert ((result.collectives["kind"] == "all_reduce") & (result.collectives["phase"] == "forward")).any()


def test_a_wrong_prediction_is_caught():
    """verify fails when the plan's collectives are off by one (the check can fail)."""
    model = _llama()
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(2, 128), dtype=F32, sequence_parallel=True,
                    allow_replicated_units=False)
    rows = [dict(r) for r in plan.predictions["collectives"]]
    rows[0]["count"] += 1
    plan = plan.replace(predictions=dict(plan.predictions, collectives=rows))
    result = verify(plan, model)
    assert not result.passed and len(result.mismatches()) == 1
