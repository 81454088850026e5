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
