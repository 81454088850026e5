"""Functions the RankPool runs on every rank: build a tiny model, run a pipeline step, compare
loss and every local gradient with one device. They return numbers; the tests assert."""
from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.core.pipeline_parallel import Schedule1F1B, ScheduleInterleaved1F1B, build_stages, schedule_facts
VOCAB = 96


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_model(kind: str, tie: bool, n_layers: int, seed: int = 0):
    """A fresh copy (HF construction costs ~0.7 s here, a deep copy ~1 ms; ties survive the copy)."""
    return copy.deepcopy(_built(kind, tie, n_layers, seed))


@functools.lru_cache(maxsize=None)
def _built(kind: str, tie: bool, n_layers: int, seed: int):
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


def data(batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, seq), generator=g)
    y = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return x, y


def reference(kind: str, tie: bool, n_layers: int, x, y, **kwargs):
    model = build_model(kind, tie, n_layers)
    out = model(x, **kwargs)
    loss = lm_loss(out.logits if hasattr(out, "logits") else out, y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def compare(stages, ref_grads, loss, ref_loss) -> dict:
    """Relative loss error, and the largest gradient error of this rank's parameters, each
    measured as max|got - ref| / max|ref| over the tensor (1.0 if any element misses
    rtol 1e-4 with atol 1e-6 * max|ref|)."""
    worst_grad, n = 0.0, 0
    for st in stages:
        for name, p in st.module.named_parameters(remove_duplicate=False):
            ref = ref_grads[name]
            got = _full(p.grad) if p.grad is not None else torch.zeros_like(ref)
            err = ((got - ref).abs().max() / (ref.abs().max() + 1e-12)).item()
            if not torch.allclose(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item()):
                err = max(err, 1.0)  # an element off by more than rtol 1e-4 counts as a failure
            worst_grad = max(worst_grad, err)
            n += 1
    loss_err = None if loss is None else abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return dict(loss_err=loss_err, grad_err=worst_grad, n_params=n)


def run_pure_pp(cases, overlap: bool = False, second_step: bool = True) -> list[dict]:
    """cases: (kind, tie, schedule name, n_microbatches, n_layers, batch, seq). With
    ``second_step``, a second step at half the sequence length follows (new boundary shapes)."""
    out = []
    p = dist.get_world_size()
    for kind, tie, name, m, n_layers, batch, seq in cases:
        x, y = data(batch, seq)
        ref_loss, ref_grads = reference(kind, tie, n_layers, x, y)
        model = build_model(kind, tie, n_layers)
        cls = schedule_facts(name).schedule_class
        ir = cls.ir(p, m)
        stages = build_stages(model, ir)
        sched = cls(stages, m, lm_loss, overlap=overlap)
        losses: list = []
        loss = sched.step(x, target=y, losses=losses)
        res = compare(stages, ref_grads, loss, ref_loss)
        res.update(case=(kind, tie, name, m), n_losses=len(losses))
        out.append(res)
        if not second_step:
            continue
        # a second step with another sequence length, inputs given only where they are used:
        # every rank re-learns the boundaries together, numerics hold
        x2, y2 = data(batch, seq // 2, seed=2)
        ref2, ref_grads2 = reference(kind, tie, n_layers, x2, y2)
        for st in stages:
            st.module.zero_grad(set_to_none=True)
        first = 0 in {st.stage_index for st in stages}
        last = ir.n_stages - 1 in {st.stage_index for st in stages}
        loss2 = sched.step(*((x2,) if first else ()), target=y2 if last else None)
        res2 = compare(stages, ref_grads2, loss2, ref2)
        res["grad_err"] = max(res["grad_err"], res2["grad_err"])
        if loss is not None:
            res["loss_err"] = max(res["loss_err"], res2["loss_err"])
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
    from hyper_parallel.local import cached_mesh
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
        cls = schedule_facts(name).schedule_class
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


def torch_schedule(name: str, stages, m: int, loss_fn):
    """torch.distributed.pipelining's counterpart of one of our schedules."""
    import torch.distributed.pipelining as tp
    cls = getattr(tp, schedule_facts(name).torch_class)
    single = issubclass(cls, tp.schedules.PipelineScheduleSingle)   # takes one stage, not a list
    return cls(stages[0] if single else stages, m, loss_fn=loss_fn)


def torch_stages(model, ir, group=None):
    """The same split, wrapped in torch.distributed.pipelining's PipelineStage."""
    from torch.distributed.pipelining import PipelineStage as TorchStage
    ours = build_stages(model, ir, group=group)
    return [TorchStage(s.module, s.stage_index, s.num_stages, torch.device("cpu"), group=group) for s in ours]


def run_torch_compare(cases) -> list[dict]:
    """Per-micro-batch losses (and, untied, gradients) of ours vs torch's on the same split."""
    p = dist.get_world_size()
    out = []
    for kind, tie, name, m, n_layers, batch, seq in cases:
        x, y = data(batch, seq)
        cls = schedule_facts(name).schedule_class
        ir = cls.ir(p, m)
        ours_model, theirs_model = build_model(kind, tie, n_layers), build_model(kind, tie, n_layers)
        ours = build_stages(ours_model, ir)
        mine: list = []
        cls(ours, m, lm_loss).step(x, target=y, losses=mine)
        theirs_stages = torch_stages(theirs_model, ir)
        theirs: list = []
        torch_schedule(name, theirs_stages, m, lm_loss).step(x, target=y, losses=theirs)
        loss_err = max((abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(mine, theirs)), default=None)
        grad_err = 0.0
        if not tie:
            for o, t in zip(ours, theirs_stages):
                for (n1, p1), (n2, p2) in zip(o.module.named_parameters(), t.submod.named_parameters()):
                    grad_err = max(grad_err, ((p1.grad - p2.grad).abs().max() / p2.grad.abs().max()).item())
        out.append(dict(case=(kind, tie, name, m), n_mine=len(mine), n_theirs=len(theirs),
                        loss_err=loss_err, grad_err=grad_err))
    return out


def run_errors() -> list[str]:
    """Bad input fails on every rank before any communication, so nothing hangs."""
    from hyper_parallel.core.pipeline_parallel import from_orders
    from hyper_parallel.core.pipeline_parallel.schedule_ir import B as Bw, F as Fw
    from hyper_parallel.errors import MicrobatchError, ScheduleError
    msgs = []
    model = build_model("titan", False, 2)
    ir = Schedule1F1B.ir(2, 4)
    stages = build_stages(model, ir)
    sched = Schedule1F1B(stages, 4, lm_loss)
    x, y = data(6, 8)
    try:
        sched.step(x, target=y)
    except MicrobatchError as e:
        msgs.append(str(e))
    deadlock = from_orders("hand", 2, (0, 1), [[Fw(0, 0), Bw(0, 0), Fw(0, 1), Bw(0, 1)],
                                               [Fw(1, 1), Bw(1, 1), Fw(1, 0), Bw(1, 0)]])
    try:
        Schedule1F1B(stages, 2, lm_loss, schedule=deadlock)
    except ScheduleError as e:
        msgs.append(str(e))
    try:
        ScheduleInterleaved1F1B(build_stages(build_model("titan", False, 4),
                                             ScheduleInterleaved1F1B.ir(2, 4)), 3, lm_loss)
    except ScheduleError as e:
        msgs.append(str(e))
    x, y = data(4, 8)
    loss = sched.step(x, target=y)  # the pipeline still works after refusing bad input
    msgs.append("ok" if loss is None or loss.item() > 0 else "bad")
    return msgs


class _ToyBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d, bias=False)
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class _Toy(torch.nn.Module):
    """Blocks whose TP output stays a sequence-sharded DTensor between stages."""

    def __init__(self, d: int = 16, n: int = 4, vocab: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_ToyBlock(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def run_kwargs_and_counts(cases) -> list[dict]:
    """HF Llama with a left-padding attention mask passed as a step kwarg (split per micro-batch,
    seen by every stage), at micro-batch counts that are not powers of two.
    cases: (schedule name, n_microbatches, batch)."""
    out = []
    p = dist.get_world_size()
    for name, m, batch in cases:
        x, y = data(batch, 8)
        mask = torch.ones(batch, 8, dtype=torch.long)
        mask[::2, :3] = 0  # every other row left-padded
        ref_loss, ref_grads = reference("hf", True, 4, x, y, attention_mask=mask)
        cls = schedule_facts(name).schedule_class
        stages = build_stages(build_model("hf", True, 4), cls.ir(p, m))
        losses: list = []
        loss = cls(stages, m, lm_loss).step(x, target=y, losses=losses, attention_mask=mask)
        res = compare(stages, ref_grads, loss, ref_loss)
        res.update(case=("hf+mask", True, name, m), n_losses=len(losses))
        out.append(res)
    return out


def run_dtensor_activations(names) -> list[dict]:
    """(pp=2, tp=2): every block ends in RowwiseParallel(output_layouts=Shard(1),
    use_local_output=False), so DTensors with Shard(1) cross the stage boundary."""
    from hyper_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from hyper_parallel.local import cached_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = cached_mesh((2, 2), ("pp", "tp"))
    tp_mesh = mesh["tp"]
    x, y = data(4, 8)
    x, y = x % 32, y % 32
    out = []
    for name in names:
        torch.manual_seed(0)
        ref = _Toy()
        model = copy.deepcopy(ref)
        loss_ref = lm_loss(ref(x), y)
        loss_ref.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                       use_local_output=False),
                "blocks.*.up": ColwiseParallel(input_layouts=Shard(1)),
                "blocks.*.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        parallelize_module(model, tp_mesh, plan, src_data_rank=None)
        cls = schedule_facts(name).schedule_class
        stages = build_stages(model, cls.ir(2, 4), group=mesh["pp"].get_group(), activation_mesh=tp_mesh)
        seen = []
        for st in stages:
            st.module.register_forward_hook(lambda m, a, o: seen.append(
                (isinstance(a[0], DTensor) and tuple(a[0].placements)) or None))
        loss = cls(stages, 4, lm_loss).step(x, target=y)
        res = compare(stages, ref_grads, loss, loss_ref.detach())
        res.update(case=name, dtensor_inputs=sorted({str(s) for s in seen}))
        out.append(res)
    return out


class InjectedFailure(RuntimeError):
    """The error the fail-fast test raises inside one rank's stage."""


def run_fail_fast(fail_rank: int, fail_at_call: int = 2, m: int = 4) -> dict:
    """A 1F1B step on a fresh gloo group of every rank in which ``fail_rank``'s stage raises at
    its ``fail_at_call``-th forward: what every rank raised, and how long after the step began.
    A fresh group, so the messages abandoned by the failure never reach a later test's step."""
    import time

    from hyper_parallel.errors import PipelinePeerFailedError

    group = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    p = dist.get_world_size()
    x, y = data(4, 8)
    ir = Schedule1F1B.ir(p, m)
    stages = build_stages(build_model("titan", False, p), ir, group=group)
    if rank == fail_rank:
        module, calls = stages[0].module, []
        original = module.forward

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == fail_at_call:
                raise InjectedFailure(f"injected on rank {rank}")
            return original(*args, **kwargs)

        module.forward = failing
    sched = Schedule1F1B(stages, m, lm_loss)
    t0 = time.perf_counter()
    try:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == p - 1 else None)
        return dict(rank=rank, error=None, seconds=time.perf_counter() - t0)
    except PipelinePeerFailedError as exc:
        return dict(rank=rank, error=type(exc).__name__, failed_rank=exc.failed_rank, message=str(exc),
                    seconds=time.perf_counter() - t0)
    except InjectedFailure as exc:
        return dict(rank=rank, error=type(exc).__name__, failed_rank=rank, message=str(exc),
                    notes=list(getattr(exc, "__notes__", [])), seconds=time.perf_counter() - t0)
