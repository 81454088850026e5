"""Functions the RankPool runs on every rank: build a tiny model, run a pipeline step, compare
loss and every local gradient with one device. They return numbers; the tests assert."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.core.pipeline_parallel import (
    Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble, build_stages,
)

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZeroBubble": ScheduleZeroBubble, "ZBV": ScheduleZBV}
VOCAB = 96


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_model(kind: str, tie: bool, n_layers: int, seed: int = 0):
    if kind == "titan":
        from autoplan.models.llama import build_llama
        return build_llama(seed, n_layers=n_layers, tie_embeddings=tie, dim=32, n_heads=4, n_kv_heads=2,
                           vocab_size=VOCAB, ffn_hidden=64, max_seq_len=16)
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=16, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    return model


class _Logits(torch.nn.Module):
    """HF models return an output object; the reference takes its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return out.logits if hasattr(out, "logits") else out


def data(batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return x, y


def reference(kind: str, tie: bool, n_layers: int, x, y):
    model = build_model(kind, tie, n_layers)
    loss = lm_loss(_Logits(model)(x), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(stages, ref_grads, loss, ref_loss) -> dict:
    """Largest relative errors of the loss and of every gradient this rank holds."""
    worst_grad, n = 0.0, 0
    for st in stages:
        for name, p in st.module.named_parameters(remove_duplicate=False):
            name = name.replace("_checkpoint_wrapped_module.", "")
            ref = ref_grads[name]
            got = _local(p.grad) if p.grad is not None else torch.zeros_like(ref)
            err = ((got - ref).abs() / (ref.abs() + 1e-6)).max().item() if False else \
                ((got - ref).abs().max() / (ref.abs().max() + 1e-12)).item()
            worst_grad = max(worst_grad, err)
            n += 1
    loss_err = None if loss is None else abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return dict(loss_err=loss_err, grad_err=worst_grad, n_params=n)


def run_pure_pp(cases) -> list[dict]:
    """cases: (kind, tie, schedule name, n_microbatches, n_layers, batch, seq)."""
    out = []
    p = dist.get_world_size()
    for kind, tie, name, m, n_layers, batch, seq in cases:
        x, y = data(batch, seq)
        ref_loss, ref_grads = reference(kind, tie, n_layers, x, y)
        model = build_model(kind, tie, n_layers)
        cls = SCHEDULES[name]
        ir = cls.ir(p, m)
        stages = build_stages(model, ir)
        sched = cls(stages, m, lm_loss)
        losses: list = []
        loss = sched.step(x, target=y, losses=losses)
        res = compare(stages, ref_grads, loss, ref_loss)
        res.update(case=(kind, tie, name, m), n_losses=len(losses))
        out.append(res)
    return out


def tp_plan(kind: str, tie: bool) -> dict:
    """Megatron-style TP for the blocks; vocab-parallel embedding and column head when untied."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor import Replicate
    if kind == "titan":
        block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                 "feed_forward.w2": RowwiseParallel()}
        plan = {"layers.*": block}
        if not tie:
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
            plan["output"] = ColwiseParallel(output_layouts=Replicate())
        return plan
    block = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel()}
    plan = {"model.layers.*": block}
    if not tie:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def run_parallel(cases, dp: int) -> list[dict]:
    """(pp, tp) when dp == 1, (dp, pp, tp) with fully_shard over dp otherwise; pp = tp = 2.

    cases: (kind, tie, schedule name, n_microbatches, n_layers, batch, seq). Each dp rank takes
    its slice of the batch; the reference is one device on the whole batch.
    """
    from hyper_parallel import fully_shard, parallelize_module
    from hyper_parallel.testing import cached_mesh
    if dp == 1:
        mesh = cached_mesh((2, 2), ("pp", "tp"))
    else:
        mesh = cached_mesh((dp, 2, 2), ("dp", "pp", "tp"))
    pp_group, tp_mesh = mesh["pp"].get_group(), mesh["tp"]
    dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
    out = []
    for kind, tie, name, m, n_layers, batch, seq in cases:
        x, y = data(batch, seq)
        ref_loss, ref_grads = reference(kind, tie, n_layers, x, y)
        model = build_model(kind, tie, n_layers)
        parallelize_module(model, tp_mesh, tp_plan(kind, tie), src_data_rank=None)
        cls = SCHEDULES[name]
        stages = build_stages(model, cls.ir(2, m), group=pp_group, activation_mesh=tp_mesh)
        if dp > 1:
            tied = {id(p) for st in stages for g in st.module.tied_groups
                    for s, fqn in g.items() if s == st.stage_index
                    for p in [st.module.get_parameter(fqn)]}
            ignored = {p for st in stages for p in st.module.parameters() if id(p) in tied}
            for st in stages:
                for layer in [u for u in st.module.units if ".layers." in f".{u}"]:
                    fully_shard(st.module.get_submodule(layer), mesh=mesh["dp"], ignored_params=ignored)
                fully_shard(st.module, mesh=mesh["dp"], ignored_params=ignored)
        per = batch // dp
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        sched = cls(stages, m, lm_loss, dp_group=mesh["dp"].get_group() if dp > 1 else None)
        loss = sched.step(xs, target=ys)
        res = compare(stages, ref_grads, None, ref_loss)
        res.update(case=(kind, tie, name, m), loss=None if loss is None else loss.item(),
                   ref_loss=ref_loss.item())
        out.append(res)
    return out
