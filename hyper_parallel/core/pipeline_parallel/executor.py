"""Run one rank's program of a lowered schedule with torch.distributed point-to-point.

Consecutive communication actions form one batch: their isend/irecv go out together through
``batch_isend_irecv``. Receives are waited when the data is needed; sends are waited at the end
of the step (the validator's "sends never block" semantics). Every message carries a tag made of
(direction, stage, micro-batch, tensor index), so gloo matches them whatever the order; for
untagged backends validate with ``fifo=True``. With ``overlap`` the receives of the next batch
are posted before the compute in between runs.

MPipe (mpipe.py, mpipe_ir.py): PRE_F / PRE_B run the tower on its owner; stage 0 gets the tower
output as fresh leaves (locally, or from RECV_PRE). On tagged backends (``post_ahead``) a rank
posts *all* its transposed receives of the step in one ``batch_isend_irecv`` as soon as the
shapes are known (after its first PRE_F: stage 0's rank always owns micro-batch 0) and each
RECV_PRE / RECV_PRE_B action then only waits, so the transfers overlap each other and stage 0's
forwards. Untagged backends (``fifo``) post each where the program has it.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from hyper_parallel.core.pipeline_parallel.mpipe import PreprocessState
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    RECV_KINDS, Action, ActionKind, PipelineSchedule, peer_of, preprocess_owner,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage, TensorMeta, dtensor_from_meta, local_of
from hyper_parallel.errors import PipelineError

log = logging.getLogger(__name__)
K = ActionKind
MAX_TENSORS = 64  # tensors per stage boundary; bounds the tag space


def _tag(direction: int, stage: int, mb: int, idx: int, n_mb: int) -> int:
    return (((stage * 2 + direction) * n_mb) + mb) * MAX_TENSORS + idx


class StepState:
    """Everything one step passes between the actions of one rank."""

    def __init__(self, stages: dict[int, PipelineStage], mb_args, mb_kwargs, targets, loss_fn,
                 scale: float, in_meta: dict[int, list[TensorMeta]], n_mb: int,
                 loss_context: Callable[[], ContextManager] | None = None,
                 pre: PreprocessState | None = None):
        self.stages, self.mb_args, self.mb_kwargs = stages, mb_args, mb_kwargs
        self.loss_context = loss_context or contextlib.nullcontext
        self.targets, self.loss_fn, self.scale = targets, loss_fn, scale
        self.in_meta, self.n_mb = in_meta, n_mb
        self.recv: dict[Action, tuple[list[torch.Tensor], list]] = {}  # recv action -> buffers, works
        self.sends: list = []
        self.losses: dict[int, torch.Tensor] = {}
        self.pre = pre
        self.failure = None   # a failfast.StepFailure: waits give up when a peer failed

    def wait(self, work) -> None:
        if self.failure is None:
            work.wait()
        else:
            self.failure.wait(work)


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _wrap_input(stage: PipelineStage, buf: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    if meta.placements is None:
        return buf
    if stage.activation_mesh is None:
        raise PipelineError(f"stage {stage.stage_index}: receives a DTensor activation but was built "
                            "without activation_mesh")
    return dtensor_from_meta(buf, stage.activation_mesh, meta)


class Executor:
    """Interprets one rank's lowered program."""

    def __init__(self, schedule: PipelineSchedule, rank: int, group, overlap: bool = False,
                 post_ahead: bool = True):
        self.schedule, self.rank, self.group, self.overlap = schedule, rank, group, overlap
        self.program = schedule.actions[rank]
        self.s2r = schedule.stage_to_rank
        self.post_ahead = post_ahead
        self.pre_recvs = [a for a in self.program if a.kind in (K.RECV_PRE, K.RECV_PRE_B)]
        self._pre_posted = not post_ahead   # the step's transposed receives go out once, together

    # ---- communication ---------------------------------------------------------------------
    def _ops_for(self, a: Action, st: StepState) -> list:
        peer = _global(self.group, peer_of(a, self.s2r))
        s, mb, n = a.stage, a.microbatch, st.n_mb
        if a.kind in (K.SEND_PRE, K.SEND_PRE_B, K.RECV_PRE, K.RECV_PRE_B):
            return self._pre_ops(a, st, peer)
        stage = st.stages[s]
        if a.kind is K.SEND_F:
            tensors = [local_of(t) for t in stage.outputs[mb]]
            return [dist.P2POp(dist.isend, t, peer, self.group, _tag(0, s + 1, mb, i, n))
                    for i, t in enumerate(tensors)]
        if a.kind is K.SEND_B:
            grads = stage.input_grads.pop(mb)
            ops = []
            for i, g in enumerate(grads):
                meta = st.in_meta[s][i]
                if g is None:
                    g = torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device)
                ops.append(dist.P2POp(dist.isend, local_of(g),
                                      peer, self.group, _tag(1, s - 1, mb, i, n)))
            return ops
        if a.kind is K.RECV_F:
            metas = st.in_meta[s]
            bufs = [torch.empty(m.shape, dtype=m.dtype, device=stage.device) for m in metas]
            st.recv[a] = (bufs, [])
            return [dist.P2POp(dist.irecv, b, peer, self.group, _tag(0, s, mb, i, n))
                    for i, b in enumerate(bufs)]
        if a.kind is K.RECV_B:
            metas = st.in_meta[s + 1]
            bufs = [torch.empty(m.shape, dtype=m.dtype, device=stage.device) for m in metas]
            st.recv[a] = (bufs, [])
            return [dist.P2POp(dist.irecv, b, peer, self.group, _tag(1, s, mb, i, n))
                    for i, b in enumerate(bufs)]
        raise PipelineError(f"rank {self.rank}: {a} is not a communication action")

    def _pre_metas(self, a: Action, st: StepState):
        if st.pre is None or st.pre.metas is None:
            raise PipelineError(f"rank {self.rank}: {a} before any tower output was computed on this rank, so the "
                                "transposed tensors' shapes are unknown (stage 0's rank must run PRE_F of "
                                "micro-batch 0 before its first RECV_PRE)")
        return st.pre.metas

    def _pre_ops(self, a: Action, st: StepState, peer: int) -> list:
        """The transposed tower output (forward: every tensor) and its gradient (backward: the
        tensors that need one, zeros where stage 0 produced none)."""
        mb, n, tag_stage = a.microbatch, st.n_mb, self.schedule.n_stages  # a tag range no stage uses
        device = st.stages[0].device if 0 in st.stages else None
        if a.kind is K.SEND_PRE:
            return [dist.P2POp(dist.isend, local_of(t), peer, self.group, _tag(0, tag_stage, mb, i, n))
                    for i, t in enumerate(st.pre.outputs[mb])]
        metas = self._pre_metas(a, st)
        if a.kind is K.SEND_PRE_B:
            grads = st.stages[0].pre_grads.pop(mb)
            ops = []
            for i, (g, meta) in enumerate(zip(grads, metas)):
                if not meta.requires_grad:
                    continue
                g = torch.zeros(meta.shape, dtype=meta.dtype, device=device) if g is None else local_of(g)
                ops.append(dist.P2POp(dist.isend, g, peer, self.group, _tag(1, tag_stage, mb, i, n)))
            return ops
        if device is None:
            device = next(iter(st.stages.values())).device
        idx = [i for i, m in enumerate(metas) if a.kind is K.RECV_PRE or m.requires_grad]
        bufs = [torch.empty(metas[i].shape, dtype=metas[i].dtype, device=device) for i in idx]
        st.recv[a] = (bufs, [])
        direction = 0 if a.kind is K.RECV_PRE else 1
        return [dist.P2POp(dist.irecv, b, peer, self.group, _tag(direction, tag_stage, mb, i, n))
                for i, b in zip(idx, bufs)]

    def _post(self, batch: list[Action], st: StepState) -> None:
        ops, owners = [], []
        if not self._pre_posted and any(a.kind in (K.RECV_PRE, K.RECV_PRE_B) for a in batch):
            self._pre_posted = True
            batch = list(batch) + [a for a in self.pre_recvs if a not in batch]  # all of them, once
        for a in batch:
            if a.kind in RECV_KINDS and a in st.recv:
                continue  # already posted ahead (overlap, or MPipe's transposed receives)
            new = self._ops_for(a, st)
            ops += new
            owners += [a] * len(new)
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for a, op, w in zip(owners, ops, works):
            if a.kind in RECV_KINDS:
                st.recv[a][1].append(w)
            else:
                st.sends.append((w, op.tensor))

    def _take(self, a: Action, st: StepState) -> list[torch.Tensor]:
        bufs, works = st.recv.pop(a)
        for w in works:
            st.wait(w)
        return bufs

    # ---- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action, st: StepState) -> None:
        s, mb = a.stage, a.microbatch
        stage = st.stages[s]
        if s == 0:
            args = st.mb_args[mb]
        elif s - 1 in st.stages:
            args = list(st.stages[s - 1].outputs[mb])
        else:
            bufs = self._take(Action(K.RECV_F, s, mb), st)
            args = [_wrap_input(stage, b, m) for b, m in zip(bufs, st.in_meta[s])]
        pre = None
        if s == 0 and st.pre is not None:
            pre = self._tower_output(mb, st)
        out = stage.forward(mb, args, st.mb_kwargs[mb], pre=pre)
        if stage.is_last and st.loss_fn is not None:
            value = out[0] if len(out) == 1 else tuple(out)
            with st.loss_context():
                loss = st.loss_fn(value, st.targets[mb])
            st.losses[mb] = loss.detach()
            stage.set_loss(mb, loss * st.scale)

    def _tower_output(self, mb: int, st: StepState):
        """(keyword, tensors, needs-grad flags) of micro-batch mb's tower output for stage 0."""
        metas = self._pre_metas(Action(K.RECV_PRE, 0, mb), st)
        if preprocess_owner(self.s2r, mb) == self.rank:
            tensors = st.pre.outputs[mb]
        else:
            stage = st.stages[0]
            bufs = self._take(Action(K.RECV_PRE, 0, mb), st)
            tensors = [_wrap_input(stage, b, m) for b, m in zip(bufs, metas)]
        return st.pre.pre.into, tensors, [m.requires_grad for m in metas], st.pre.pre.unpack

    def _tower_backward(self, mb: int, st: StepState) -> None:
        metas = st.pre.metas
        if preprocess_owner(self.s2r, mb) == self.s2r[0]:
            grads = st.stages[0].pre_grads.pop(mb)
        else:
            got = iter(self._take(Action(K.RECV_PRE_B, 0, mb), st))
            grads = [next(got) if m.requires_grad else None for m in metas]
        st.pre.backward(mb, grads)

    def _backward(self, a: Action, st: StepState, mode: str) -> None:
        s, mb = a.stage, a.microbatch
        stage = st.stages[s]
        grads = None
        if not stage.is_last and mode != "weight":
            if s + 1 in st.stages:
                grads = st.stages[s + 1].input_grads.pop(mb)
            else:
                grads = self._take(Action(K.RECV_B, s, mb), st)
        if stage.is_last and st.loss_fn is None:
            raise PipelineError(f"stage {s}: the last stage needs a loss_fn to run backward")
        with st.loss_context() if stage.is_last else contextlib.nullcontext():
            stage.backward(mb, grads, mode)

    # ---- the program -----------------------------------------------------------------------
    def run(self, st: StepState, fsdp_hooks: dict[str, Callable[[int], None]] | None = None) -> None:
        prog, i = self.program, 0
        while i < len(prog):
            a = prog[i]
            if a.is_comm:
                j = i
                while j < len(prog) and prog[j].is_comm:
                    j += 1
                self._post(prog[i:j], st)
                if self.overlap:
                    k = j
                    while k < len(prog) and not prog[k].is_comm:
                        k += 1
                    ahead = []
                    while k < len(prog) and prog[k].is_comm:
                        if prog[k].kind in RECV_KINDS:
                            ahead.append(prog[k])
                        k += 1
                    if ahead:
                        self._post(ahead, st)
                i = j
                continue
            if a.kind is K.FORWARD:
                self._forward(a, st)
            elif a.kind is K.BACKWARD:
                self._backward(a, st, "full")
            elif a.kind is K.BACKWARD_INPUT:
                self._backward(a, st, "input")
            elif a.kind is K.BACKWARD_WEIGHT:
                self._backward(a, st, "weight")
            elif a.kind is K.PRE_F:
                st.pre.forward(a.microbatch)
                if not self._pre_posted and self.pre_recvs:  # shapes known now: post them all at once
                    self._post(list(self.pre_recvs), st)
            elif a.kind is K.PRE_B:
                self._tower_backward(a.microbatch, st)
            elif a.kind is K.REDUCE_PRE:
                st.pre.reduce(self.group)
            elif fsdp_hooks is not None and a.kind.value in fsdp_hooks:
                fsdp_hooks[a.kind.value](a.stage)
            i += 1
        for w, _ in st.sends:
            st.wait(w)
        st.sends.clear()
        if st.recv:
            raise PipelineError(f"rank {self.rank}: receives never consumed: {sorted(map(str, st.recv))}")


def run_program(schedule: PipelineSchedule, rank: int, group, st: StepState, overlap: bool = False,
                fsdp_hooks=None, post_ahead: bool = True) -> dict[int, torch.Tensor]:
    Executor(schedule, rank, group, overlap, post_ahead).run(st, fsdp_hooks)
    return st.losses

