"""The schedule IR: per rank, the ordered list of actions the executor runs and the simulator times.

A schedule is data, not code, so that the planner can time exactly what the runtime will run.
Compute actions (F, B, I = backward-input/dx, W = backward-weight/dw) come from a generator;
``lower`` then inserts the point-to-point actions (and optionally the FSDP ones) that connect
stages living on different ranks. Nothing here imports torch.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from hyper_parallel.errors import ScheduleError


class ActionKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"          # full backward: dx and dw together
    BACKWARD_INPUT = "I"    # dx only; its W must follow on the same rank
    BACKWARD_WEIGHT = "W"   # dw only
    SEND_F = "SEND_F"       # send this stage's output to the next stage's rank
    RECV_F = "RECV_F"       # receive this stage's input from the previous stage's rank
    SEND_B = "SEND_B"       # send the gradient of this stage's input to the previous stage's rank
    RECV_B = "RECV_B"       # receive the gradient of this stage's output from the next stage's rank
    UNSHARD = "UNSHARD"     # FSDP: all-gather the stage's parameters
    RESHARD = "RESHARD"     # FSDP: free the gathered parameters
    REDUCE_GRAD = "REDUCE_GRAD"  # FSDP/DP: reduce the accumulated gradients of the stage
    # MPipe (mpipe.py): the preprocess tower of micro-batch mb runs on its owner rank
    # (preprocess_owner), which "transposes" the output to stage 0's rank and gets its gradient back
    PRE_F = "PF"                 # tower forward of micro-batch mb, on its owner; graph kept there
    PRE_B = "PB"                 # tower backward of micro-batch mb, on its owner
    SEND_PRE = "SEND_PRE"        # owner -> stage 0's rank: the tower output
    RECV_PRE = "RECV_PRE"        # stage 0's rank <- owner
    SEND_PRE_B = "SEND_PRE_B"    # stage 0's rank -> owner: the gradient of the tower output
    RECV_PRE_B = "RECV_PRE_B"    # owner <- stage 0's rank
    REDUCE_PRE = "REDUCE_PRE"    # every rank: sum this step's tower gradients over the pipeline ranks


PRE_KINDS = frozenset({ActionKind.PRE_F, ActionKind.PRE_B})
PRE_COMM_KINDS = frozenset({ActionKind.SEND_PRE, ActionKind.RECV_PRE, ActionKind.SEND_PRE_B,
                            ActionKind.RECV_PRE_B})
COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD,
                           ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}) | PRE_KINDS
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}) \
    | PRE_COMM_KINDS
RECV_KINDS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.RECV_PRE, ActionKind.RECV_PRE_B})
SEND_KINDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.SEND_PRE, ActionKind.SEND_PRE_B})
FSDP_KINDS = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD})


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` applied to ``stage`` for ``microbatch`` (None for FSDP actions)."""

    kind: ActionKind
    stage: int
    microbatch: int | None = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        if self.kind in PRE_KINDS:
            return f"{self.kind.value}{mb}"
        return f"{self.stage}{self.kind.value}{mb}" if self.kind in COMPUTE_KINDS else \
            f"{self.kind.value}(s{self.stage}{'' if self.microbatch is None else ',mb' + mb})"

    def _replace_kind(self, kind: "ActionKind") -> "Action":
        return Action(kind, self.stage, self.microbatch)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_preprocess(self) -> bool:
        return self.kind in PRE_KINDS


# Actions are immutable values; the planner builds schedules with hundreds of thousands of
# them, so the constructors hand out one shared instance per (stage, micro-batch).
@functools.lru_cache(maxsize=None)
def F(stage: int, mb: int) -> Action:
    return Action(ActionKind.FORWARD, stage, mb)


@functools.lru_cache(maxsize=None)
def B(stage: int, mb: int) -> Action:
    return Action(ActionKind.BACKWARD, stage, mb)


@functools.lru_cache(maxsize=None)
def I(stage: int, mb: int) -> Action:  # noqa: E743 - the literature's name for backward-input
    return Action(ActionKind.BACKWARD_INPUT, stage, mb)


@functools.lru_cache(maxsize=None)
def W(stage: int, mb: int) -> Action:
    return Action(ActionKind.BACKWARD_WEIGHT, stage, mb)


@functools.lru_cache(maxsize=None)
def PF(mb: int) -> Action:
    """Tower forward of micro-batch mb (stage field 0: the stage it feeds)."""
    return Action(ActionKind.PRE_F, 0, mb)


@functools.lru_cache(maxsize=None)
def PB(mb: int) -> Action:
    """Tower backward of micro-batch mb."""
    return Action(ActionKind.PRE_B, 0, mb)


def preprocess_owner(stage_to_rank: Sequence[int], mb: int) -> int:
    """MPipe's owner of micro-batch mb: round-robin over the pipeline ranks, starting at stage 0's
    rank (so micro-batch 0's tower is local to stage 0 and its output shapes are known there
    before any transposed receive is posted)."""
    n = max(stage_to_rank) + 1
    return (stage_to_rank[0] + mb) % n


def loop_placement(n_ranks: int, n_stages: int) -> tuple[int, ...]:
    """Stage s on rank s % n_ranks (GPipe, 1F1B, interleaved): stages wrap around the ranks."""
    return tuple(s % n_ranks for s in range(n_stages))


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2p-1-r (ZBV)."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


@dataclass
class PipelineSchedule:
    """A whole pipeline step: which rank owns each stage and what every rank does, in order.

    ``actions[r]`` is rank r's program. A schedule straight from a generator holds compute actions
    only; :func:`lower` returns the version with P2P (and FSDP) actions that the executor runs.
    """

    name: str
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]]
    uses_split_backward: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def is_lowered(self) -> bool:
        return any(a.kind not in COMPUTE_KINDS for prog in self.actions for a in prog)

    def compute_only(self) -> "PipelineSchedule":
        return self._with([[a for a in prog if a.is_compute] for prog in self.actions])

    def _with(self, actions: list[list[Action]]) -> "PipelineSchedule":
        return PipelineSchedule(self.name, self.n_microbatches, self.stage_to_rank, actions,
                                self.uses_split_backward, dict(self.meta))

    def format(self) -> str:
        """One line per rank, compute actions only: the usual way schedules are drawn."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in prog if a.is_compute)
                         for r, prog in enumerate(self.actions))

    def to_dataframe(self):
        """Every action as a row (rank, step, action, kind, stage, microbatch), for notebooks."""
        import pandas as pd

        rows = [dict(rank=r, step=i, action=str(a), kind=a.kind.value, stage=a.stage,
                     microbatch=a.microbatch)
                for r, prog in enumerate(self.actions) for i, a in enumerate(prog)]
        return pd.DataFrame(rows, columns=["rank", "step", "action", "kind", "stage", "microbatch"])


def peer_of(action: Action, stage_to_rank: Sequence[int]) -> int:
    """The rank a communication action talks to."""
    if action.kind in (ActionKind.SEND_PRE, ActionKind.RECV_PRE_B):
        return stage_to_rank[0]
    if action.kind in (ActionKind.RECV_PRE, ActionKind.SEND_PRE_B):
        return preprocess_owner(stage_to_rank, action.microbatch)
    if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
        return stage_to_rank[action.stage + 1]
    if action.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
        return stage_to_rank[action.stage - 1]
    raise ScheduleError(f"{action} is not a communication action")


def matching(action: Action) -> Action:
    """The action on the peer rank that pairs with a send or receive."""
    k, s, mb = action.kind, action.stage, action.microbatch
    pairs = {ActionKind.SEND_F: (ActionKind.RECV_F, s + 1), ActionKind.RECV_F: (ActionKind.SEND_F, s - 1),
             ActionKind.SEND_B: (ActionKind.RECV_B, s - 1), ActionKind.RECV_B: (ActionKind.SEND_B, s + 1),
             ActionKind.SEND_PRE: (ActionKind.RECV_PRE, s), ActionKind.RECV_PRE: (ActionKind.SEND_PRE, s),
             ActionKind.SEND_PRE_B: (ActionKind.RECV_PRE_B, s), ActionKind.RECV_PRE_B: (ActionKind.SEND_PRE_B, s)}
    if k not in pairs:
        raise ScheduleError(f"{action} is not a communication action")
    kind, stage = pairs[k]
    return Action(kind, stage, mb)


def lower(schedule: PipelineSchedule, fsdp: bool = False) -> PipelineSchedule:
    """Insert sends right after the producing compute and receives right before the consumer.

    Stages that sit on the same rank (the bottom of ZBV's V) hand tensors over locally, with no
    communication action. With ``fsdp`` each stage gets UNSHARD before its first compute action,
    and REDUCE_GRAD then RESHARD after its last backward. With MPipe (``meta["preprocess"]``) the
    tower output travels owner -> stage 0's rank right after PRE_F and is received right before
    stage 0's forward; its gradient goes back right after stage 0's B (or I) and is received
    right before PRE_B; every rank ends with REDUCE_PRE.
    """
    s2r, last = schedule.stage_to_rank, schedule.n_stages - 1
    pre = bool(schedule.meta.get("preprocess"))
    out: list[list[Action]] = []
    for rank, prog in enumerate(schedule.actions):
        compute = [a for a in prog if a.is_compute]
        lowered: list[Action] = []
        first_use = {}
        last_bwd = {}
        for i, a in enumerate(compute):
            if a.kind in PRE_KINDS:
                continue  # the tower is not a stage: no FSDP bookkeeping, no stage-0 ownership
            first_use.setdefault(a.stage, i)
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                last_bwd[a.stage] = i
        for i, a in enumerate(compute):
            s, mb = a.stage, a.microbatch
            if a.kind in PRE_KINDS:
                remote = preprocess_owner(s2r, mb) != s2r[0]
                if a.kind is ActionKind.PRE_B and remote:
                    lowered.append(Action(ActionKind.RECV_PRE_B, 0, mb))
                lowered.append(a)
                if a.kind is ActionKind.PRE_F and remote:
                    lowered.append(Action(ActionKind.SEND_PRE, 0, mb))
                continue
            remote_pre = pre and s == 0 and preprocess_owner(s2r, mb) != rank
            if remote_pre and a.kind is ActionKind.FORWARD:
                lowered.append(Action(ActionKind.RECV_PRE, 0, mb))
            if fsdp and first_use.get(s) == i:
                lowered.append(Action(ActionKind.UNSHARD, s))
            if a.kind is ActionKind.FORWARD and s > 0 and s2r[s - 1] != rank:
                lowered.append(Action(ActionKind.RECV_F, s, mb))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s < last and s2r[s + 1] != rank:
                lowered.append(Action(ActionKind.RECV_B, s, mb))
            lowered.append(a)
            if a.kind is ActionKind.FORWARD and s < last and s2r[s + 1] != rank:
                lowered.append(Action(ActionKind.SEND_F, s, mb))
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and s > 0 and s2r[s - 1] != rank:
                lowered.append(Action(ActionKind.SEND_B, s, mb))
            if remote_pre and a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                lowered.append(Action(ActionKind.SEND_PRE_B, 0, mb))
            if fsdp and last_bwd.get(s) == i:
                lowered += [Action(ActionKind.REDUCE_GRAD, s), Action(ActionKind.RESHARD, s)]
        if pre:
            lowered.append(Action(ActionKind.REDUCE_PRE, 0))
        out.append(lowered)
    return schedule._with(out)


def peak_inflight(program: Iterable[Action]) -> int:
    """Most (stage, micro-batch) chunks one rank's program holds activations for at once: a
    forward opens a chunk, its last backward piece (B, or W when dx/dw are split) closes it.
    A property of the order alone, so the planner and the cost model read it without timing."""
    live = peak = 0
    opens, closes = ActionKind.FORWARD, (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
    for a in program:
        kind = a.kind
        if kind is opens:
            live += 1
            if live > peak:
                peak = live
        elif kind in closes:
            live -= 1
    return peak


def from_orders(name: str, n_microbatches: int, stage_to_rank: Sequence[int],
                orders: Iterable[Iterable[Action]], split_backward: bool = False) -> PipelineSchedule:
    """Build a schedule from hand-written per-rank orders (compute or already lowered)."""
    return PipelineSchedule(name, n_microbatches, tuple(stage_to_rank), [list(o) for o in orders],
                            split_backward)


ScheduleGenerator = Callable[..., PipelineSchedule]
