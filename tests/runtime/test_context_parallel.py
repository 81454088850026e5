"""Context parallelism (hyper_parallel.core.context_parallel): the repo Llama, HF Llama and HF Qwen3
with cp=2, cp=4, cp=2 x tp=2 and dp=2 x cp=2 (4 gloo ranks) and dp=2 x cp=2 x tp=2 (8 ranks), ring and
all-gather attention, load-balanced layout: one training step equals one device (loss rtol 1e-5,
every gradient rtol 1e-4 / atol 1e-6, every parameter perturbed). Typed errors leave the model
unchanged; the predicted collectives equal the recorded ones on the fake group at world 8 and 64."""
import pytest
import torch

from hyper_parallel import ContextParallel, style_from_dict
from hyper_parallel.core.context_parallel import (
    CPAttention,
    chunk_ids,
    local_positions,
    predicted_collectives,
    shard_sequence,
)
from hyper_parallel.core.collective import Collective
from hyper_parallel.errors import DivisibilityError, StyleSpecError
from hyper_parallel.local import CollectiveRecorder, fake_world
from tests.runtime import cp_workers

KINDS = ("llama", "hf_llama", "hf_qwen3")
VARIANTS = ("ring", "allgather")
CASES4 = [(k, layout, v) for layout in ("cp2", "cp4", "cp2_tp2", "dp2_cp2") for k in KINDS for v in VARIANTS]


def _assert_reports(reports, n):
    for rank, rep in enumerate(reports):
        assert len(rep) == n
        for case, (ok, ref, par, bad, missing) in rep.items():
            assert ok, f"rank {rank} {case}: ref {ref} par {par} grads {bad} missing {missing}"


def test_four_ranks_equal_one_device(pool4):
    reports = pool4.run(cp_workers.check_cases, CASES4)
    _assert_reports(reports, len(CASES4))
    extra = pool4.run(cp_workers.check_layout_and_loss_parallel)
    for rank, rep in enumerate(extra):
        assert rep["roundtrip"], rank
        ok, ref, par, bad, missing = rep["loss_parallel"]
        assert ok, f"rank {rank} cp2 x tp2 with loss parallel: {ref} {par} {bad} {missing}"
    errors = pool4.run(cp_workers.check_errors)
    for rank, rep in enumerate(errors):
        assert set(rep) == {"wrong mesh dim", "unknown variant", "seq not divisible (shard_batch)", "non-causal model",
                            "padding mask", "odd local length", "rollback after a later style fails"}, rep
        for case, (message, unchanged) in rep.items():
            assert message != "no error" and unchanged, (rank, case, message)


def test_eight_ranks_dp_cp_tp_equal_one_device(pool8):
    cases = [("llama", "dp2_cp2_tp2", "ring")]   # torchtitan TP+SP inside cp shards, FSDP2 on dp x cp
    _assert_reports(pool8.run(cp_workers.check_cases, cases), len(cases))


def test_layout_is_head_and_tail_chunks():
    assert chunk_ids(4, 0) == (0, 7) and chunk_ids(4, 3) == (3, 4)
    assert local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    x = torch.arange(16).view(1, 16)
    parts = torch.cat([shard_sequence(x, 4, r) for r in range(4)], dim=1)
    assert sorted(parts.flatten().tolist()) == list(range(16))
    # every rank gets the same number of causal (query, key) pairs: the point of load balancing
    work = [int((local_positions(16, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work
    with pytest.raises(DivisibilityError, match="2·cp = 8"):
        local_positions(12, 4, 0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_cpu", "math"])
def test_block_kernels_merge_to_causal_attention(fused, monkeypatch):
    """Every rank's blocks, merged by log-sum-exp, equal one device's causal GQA attention, and the
    hand-written backward its gradients -- on torch's fused CPU kernel and on the portable math."""
    import torch.nn.functional as F

    from hyper_parallel.core.context_parallel import kernels
    from hyper_parallel.core.context_parallel.layout import local_spans

    monkeypatch.setattr(kernels, "FUSED_CPU", fused)
    torch.manual_seed(0)
    b, h, hk, seq, d = 2, 4, 2, 24, 8
    for cp in (1, 2, 3):
        q, k, v = (torch.randn(b, n, seq, d, requires_grad=True) for n in (h, hk, hk))
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        local = seq // cp
        for r in range(cp):
            mine = local_positions(seq, cp, r)
            ql, dl = shard_sequence(q.detach(), cp, r, 2), shard_sequence(dout, cp, r, 2)
            blocks = [(shard_sequence(k.detach(), cp, s, 2), shard_sequence(v.detach(), cp, s, 2), s) for s in range(cp)]
            out = lse = None
            for kl, vl, s in blocks:
                out, lse = kernels.merge(out, lse, *kernels.block_forward(ql, kl, vl, local_spans(local, cp, r),
                                                                          local_spans(local, cp, s), d ** -0.5))
            torch.testing.assert_close(out, shard_sequence(ref.detach(), cp, r, 2), rtol=1e-5, atol=1e-5)
            delta = (dl * out).sum(-1)
            for kl, vl, s in blocks:
                dq, dk, dv = kernels.block_backward(ql, kl, vl, local_spans(local, cp, r), local_spans(local, cp, s),
                                                    d ** -0.5, out, lse, dl, delta)
                grads[0][:, :, mine] += dq
                grads[1][:, :, local_positions(seq, cp, s)] += dk
                grads[2][:, :, local_positions(seq, cp, s)] += dv
        for got, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-5)


def test_style_round_trips_as_data():
    for style in (ContextParallel(), ContextParallel(variant="allgather")):
        assert style_from_dict(style.to_dict()) == style
    assert ContextParallel(variant="allgather").to_dict() == {"style": "ContextParallel",
                                                             "args": {"variant": "allgather"}}
    with pytest.raises(StyleSpecError, match="variant"):
        ContextParallel(variant="zigzag")
    with pytest.raises(StyleSpecError, match="unknown argument"):
        style_from_dict({"style": "ContextParallel", "args": {"load_balance": False}})


@pytest.mark.parametrize("world,shape", [(8, (2, 4)), (64, (8, 8))])
def test_predicted_collectives_equal_recorded_on_the_fake_group(world, shape):
    from torch.distributed.device_mesh import init_device_mesh

    cp, b, hk, h, d, local = shape[1], 2, 2, 4, 8, 16
    with fake_world(world, rank=world - 3):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "cp"))
        for variant in VARIANTS:
            q = torch.randn(b, h, local, d, requires_grad=True)
            k, v = (torch.randn(b, hk, local, d, requires_grad=True) for _ in range(2))
            with CollectiveRecorder() as rec:
                CPAttention(mesh["cp"], variant)(q, k, v).sum().backward()
            seen = sorted((e["kind"], e["phase"], e["bytes"], e["group_size"]) for e in rec.events)
            predicted = predicted_collectives(variant=variant, batch=b, seq_len=local * cp, n_kv_heads=hk,
                                              head_dim=d, cp=cp)
            expected = sorted((c.kind, c.phase, c.nbytes, cp) for c in predicted for _ in range(c.count))
            assert seen == expected, (variant, seen[:4], predicted)
    ring = predicted_collectives(variant="ring", batch=1, seq_len=8192, n_kv_heads=8, head_dim=128, cp=4, tp=2,
                                 dtype_bytes=2, calls=32)
    kv = 1 * 4 * 2048 * 128 * 2 * 2
    assert ring == [Collective("send_recv", "forward", kv, 2 * 3 * 32, "cp"),
                    Collective("send_recv", "backward", kv, 2 * 7 * 32, "cp")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_whole_model_dry_run_at_world_64_issues_exactly_the_predicted_cp_traffic(variant):
    """Repo Llama, dp=8 x cp=4 x tp=2 on the fake group: every collective on the cp group in one
    training step is a predicted one (per layer, heads sharded over tp), plus the loss's one all_reduce."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.models import build_llama
    from autoplan.models.llama_plans import EXPERT_PLANS
    from hyper_parallel import apply_context_parallel, cp_cross_entropy, parallelize_module, shard_batch

    layers, heads, kv_heads, dim, seq, cp, tp = 3, 4, 2, 32, 32, 4, 2
    with fake_world(64, rank=13):
        mesh = init_device_mesh("cpu", (8, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
        model = build_llama(seed=0, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=64,
                            ffn_hidden=64, max_seq_len=seq)
        parallelize_module(model, mesh, EXPERT_PLANS["megatron"](), mesh_dim="tp")
        apply_context_parallel(model, mesh, variant=variant)
        tokens, targets, _ = shard_batch(mesh["cp"], torch.randint(0, 64, (1, seq)), torch.randint(0, 64, (1, seq)))
        with CollectiveRecorder() as rec:
            cp_cross_entropy(model(tokens), targets, mesh["cp"]).backward()
        cp_group = mesh["cp"].get_group().group_name
        seen = sorted((e["kind"], e["phase"], e["bytes"]) for e in rec.events if e["group"] == cp_group)
    predicted = predicted_collectives(variant=variant, batch=1, seq_len=seq, n_kv_heads=kv_heads,
                                      head_dim=dim // heads, cp=cp, tp=tp, calls=layers)
    predicted.append(Collective("all_reduce", "forward", 16, 1, "cp"))   # cp_cross_entropy's sum and count
    assert seen == sorted((c.kind, c.phase, c.nbytes) for c in predicted for _ in range(c.count))
