"""The planner's MPipe step: a VL model's vision tower placed in a pipelined plan.

Why here and not in the cluster search: the pipeline search cuts the decoder's spine units; the
tower (a block group outside the spine, e.g. ``visual.blocks``) is no unit and so is priced by
none of the searched candidates. Once the search has picked its mesh, schedule and cuts, this
module prices the tower with the same TP solution and cost context (per block, from the captured
graph: ``Option.unit_values``), runs ``choose_tower_placement`` (stage 0 / own stages / MPipe on
the schedule IR) and writes the choice into ``plan.pipeline["preprocess"]``. For MPipe it also
writes every pipeline rank's extra collectives, read off the lowered MPipe IR -- the transposed
tower output and its gradient (P2P on pp) and the tower-gradient all-reduce per dtype of the
rank's local tower bytes -- so verify's pipeline dry run compares them exactly.

Tower parts outside its blocks (patch embedding, merger) are priced by the search's "rest" slot
(the last stage); their bytes are in the all-reduce (all tower parameters are reduced).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter

import torch
import torch.nn as nn

from autoplan.capture.fake import fake_device
from autoplan.capture.image_inputs import image_inputs
from autoplan.capture.patch_grid import SIZE_INPUTS, sizes_from_values
from autoplan.errors import InvalidConstraintError
from autoplan.search.pipeline.search import UnitCost
from autoplan.search.pipeline.tower_placement import choose_tower_placement
from hyper_parallel.core.collective import Collective, merged_rows
from hyper_parallel.core.fqn_pattern import fqn_matches
from hyper_parallel.core.pipeline_parallel import lower, mpipe, schedule_facts
from hyper_parallel.core.pipeline_parallel.schedule_ir import preprocess_owner
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind as K
from hyper_parallel.core.pipeline_parallel.carried import CARRIED_HEADER_BYTES
from hyper_parallel.core.pipeline_parallel.forward_split import trace_forward
from hyper_parallel.core.pipeline_parallel.image_features import INTO as IMAGE_INTO
from hyper_parallel.core.pipeline_parallel.image_features import (
    HEADER_BYTES, METHOD, ImageFeatures, runnable_placements, tower_inputs,
)
from hyper_parallel.core.pipeline_parallel.split import spine_for
from hyper_parallel.core.pipeline_parallel.stage import flatten

log = logging.getLogger(__name__)
INTO = "vision"   # the keyword split.py's vision-language spine reads the tower output from


def find_tower(model: nn.Module, graph, unit_names) -> tuple[str, str] | None:
    """(tower module, its block group id) when the captured graph has a block group outside the
    pipeline's units under a module the model feeds from extra inputs; None otherwise. The tower
    module is an FQN for a model with its own spine (its step hands the tower output to stage 0),
    and ``get_image_features`` for a model whose stages run its own forward (transformers' VL
    families: the tower is what that method runs, image_features.ImageFeatures)."""
    if image_inputs(model) is None:
        return None
    for g in graph.blocks:
        if any(n.startswith(g.id + ".") for n in unit_names) or "." not in g.id:
            continue
        module = g.id.rsplit(".", 1)[0]
        try:
            model.get_submodule(module)
        except AttributeError:
            continue
        return (module if spine_for(model) is not None else METHOD), g.id
    return None


def tower_module(model: nn.Module, module: str) -> nn.Module:
    """The module MPipe runs for a plan's ``pipeline.preprocess.module`` (see :func:`find_tower`)."""
    return ImageFeatures(model) if module == METHOD else model.get_submodule(module)


def _side_bytes(model: nn.Module, styles: dict, tp: int) -> dict[torch.dtype, int]:
    """Bytes per dtype of the local shards of a forward-split model's tower (its side modules, and a
    container's own parameter beside them: LLaVA-NeXT's ``image_newline``, whole on every rank)."""
    out: Counter = Counter()
    trace = trace_forward(model)
    for fqn in trace.side:
        for dtype, n in local_tower_bytes(model.get_submodule(fqn), fqn, styles, tp).items():
            out[dtype] += n
    for fqn in trace.side_params:
        p = model.get_parameter(fqn)
        out[p.dtype] += p.numel() * p.element_size()
    return dict(out)


def tower_params(model: nn.Module, graph, unit_names) -> tuple[list[str], list[str]]:
    """(module FQNs, parameter FQNs) a VL model's tower holds, counted with the tower (stage 0 or
    MPipe), not with a decoder unit: the spine's tower module, or the modules the model's forward
    never calls on token ids alone and a container's own parameter beside them."""
    found = find_tower(model, graph, unit_names)
    if found is None:
        return [], []
    if found[0] != METHOD:
        return [found[0]], []
    trace = trace_forward(model)
    return list(trace.side), list(trace.side_params)


def tower_units(search, best, group: str) -> list[UnitCost]:
    """One UnitCost per tower block, from the search's TP options of the block group ``group``."""
    options, _ = search.tp_solution(best.tp, best.b, best.recompute, best.cp, best.ep)
    ctx = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute)
    n, acc = 0, [0.0] * 8
    for o in options:
        if o.in_block and o.owner == group + ".*":
            n = max(n, o.count)
            acc = [a + v for a, v in zip(acc, o.unit_values(ctx))]
    return [UnitCost(f"{group}.{i}", *[a / n for a in acc], fsdp=ctx.fsdp) for i in range(n)] if n else []


def tower_tp_rows(search, best, module: str, group: str) -> list[Collective]:
    """The tensor-parallel collectives one micro-batch of the tower issues (forward and backward,
    recomputation included), from the search's TP options of its block group: what the rank that
    runs that micro-batch's tower adds -- stage 0's under "stage0", the owner's under MPipe. The
    backward ones only for the blocks the features read (:func:`live_tower_blocks`)."""
    if best.tp <= 1:
        return []
    options, _ = search.tp_solution(best.tp, best.b, best.recompute, best.cp, best.ep)
    ctx = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute)
    rows = [col for o in options if o.in_block and o.owner == group + ".*"
            for col in o.collectives(ctx) if col.dim == "tp" and col.nbytes > 0]
    live, n = live_tower_blocks(search.meta, module, group, best.b, search.seq, search.dtype)
    return [dataclasses.replace(col, count=col.count * live // n) if col.phase == "backward" else col
            for col in rows if col.phase != "backward" or live]


def local_tower_bytes(tower: nn.Module, prefix: str, styles: dict, tp: int) -> dict[torch.dtype, int]:
    """Bytes per dtype of this rank's tower parameters under the plan's TP styles: a column-wise
    module's weight and bias and a row-wise module's weight hold 1/tp (what the runtime's
    ``tower_reduce_bytes`` all-reduces: local shards)."""
    out: Counter = Counter()
    for name, p in tower.named_parameters():
        mod, _, leaf = (prefix + "." + name).rpartition(".")
        style = next((s.get("style") for pat, s in styles.items() if fqn_matches(pat, mod)), None) if tp > 1 else None
        split = style == "ColwiseParallel" or (style == "RowwiseParallel" and leaf == "weight")
        out[p.dtype] += p.numel() * p.element_size() // (tp if split else 1)
    return dict(out)


def _tower_run(model: nn.Module, module: str, b: int, seq: int, dtype, then=None):
    """Run the tower of ``model`` (the search's meta copy) on one micro-batch of ``b`` sequences:
    (its output tensors, ``then(outputs)`` -- evaluated while they are live)."""
    tokens = torch.zeros(b, seq, dtype=torch.long, device="meta")
    kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in image_inputs(model)(tokens).items() if k != "input_ids"}
    tower = tower_module(model, module)
    if module != METHOD:
        with torch.enable_grad():
            out = flatten(tower(**kwargs), "tower_outputs")
            return out, then(out) if then else None
    own, keep = tower_inputs(model, list(kwargs))
    given = {k: kwargs[k] for k in own + keep}
    sizes = {k: v for k, v in given.items() if k in SIZE_INPUTS}   # real values: a grid's splits read them
    # transformers' towers create tensors without a device (meta does not mix with them): fake ones
    with sizes_from_values(sizes), \
            fake_device(model, (), {k: v for k, v in given.items() if k not in sizes}) as (mode, _, fake_kwargs), \
            mode, torch.enable_grad():
        out = flatten(tower(**fake_kwargs, **sizes), "tower_outputs")
        return out, then(out) if then else None


def tower_outputs(model: nn.Module, module: str, b: int, seq: int, dtype) -> list[tuple[int, bool]]:
    """(bytes, needs a gradient) of each tensor the tower of ``model`` returns for one micro-batch.
    A transformers tower that cannot run on fake tensors (Qwen-VL's attention splits by values) is
    priced by what ``ImageFeatures`` sends for it: its layout header, then the features the decoder
    merges as one tensor -- one image's features per row at the decoder's width -- and one more such
    tensor per DeepStack level the vision config declares (Qwen3-VL's ``deepstack_visual_indexes``)."""
    try:
        out, _ = _tower_run(model, module, b, seq, dtype)
    except Exception as exc:  # noqa: BLE001 - any fake-tensor failure: the structural estimate below
        if module != METHOD:
            raise
        log.info("tower outputs of %s estimated (its tower does not run on fake tensors: %s)",
                 type(model).__name__, exc)
        batch = image_inputs(model)
        hidden = model.config.get_text_config().hidden_size
        features = b * batch.per_image * hidden * torch.empty((), dtype=dtype).element_size()
        levels = len(getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None) or ())
        return [(HEADER_BYTES, False)] + [(features, True)] * (1 + levels)
    return [(t.numel() * t.element_size(), t.requires_grad) for t in out]


def live_tower_blocks(model: nn.Module, module: str, group: str, b: int, seq: int, dtype) -> tuple[int, int]:
    """(tower blocks whose parameters get a gradient, all of them): a block whose output the
    features never read runs no backward (LLaVA's ``vision_feature_layer=-2`` leaves the last
    layer out), so its backward collectives are never issued. Read off autograd, not the config."""
    blocks = list(model.get_submodule(group).children())

    def live(out):
        loss = sum(t.float().sum() for t in out if t.requires_grad)
        firsts = [next(blk.parameters()) for blk in blocks]
        grads = torch.autograd.grad(loss, firsts, allow_unused=True)
        return sum(g is not None for g in grads)

    try:
        _, n = _tower_run(model, module, b, seq, dtype, live)
    except Exception as exc:  # noqa: BLE001 - a tower that does not run on fake tensors: every block counted
        log.info("live tower blocks of %s not measured (%s): all counted", type(model).__name__, exc)
        return len(blocks), len(blocks)
    return n, len(blocks)


def mpipe_rank_rows(ir, tower_out: list[tuple[int, bool]], reduce_bytes: list[int],
                    dp_dim: str | None = None) -> list[list[Collective]]:
    """Per pipeline rank, the collectives MPipe adds to ``ir`` (the un-lowered base schedule):
    each SEND_PRE / RECV_PRE moves every tower output tensor, each SEND_PRE_B / RECV_PRE_B those
    that need a gradient, REDUCE_PRE one all-reduce per dtype on pp -- and, with data parallel
    (``dp_dim``: the mesh dimension of the schedule's dp group), one more on dp (the average)."""
    lowered = lower(mpipe(ir))
    out = []
    for prog in lowered.actions:
        rows = []
        for a in prog:
            if a.kind in (K.SEND_PRE, K.RECV_PRE):
                rows += [Collective("send_recv", "forward", b, 1, "pp") for b, _ in tower_out]
            elif a.kind in (K.SEND_PRE_B, K.RECV_PRE_B):
                rows += [Collective("send_recv", "backward", b, 1, "pp") for b, g in tower_out if g]
            elif a.kind is K.REDUCE_PRE:
                rows += [Collective("all_reduce", "backward", b, 1, "pp") for b in reduce_bytes]
                if dp_dim:
                    rows += [Collective("all_reduce", "backward", b, 1, dp_dim) for b in reduce_bytes]
        out.append(rows)
    return out


def carried_sizes(model: nn.Module, b: int, seq: int, dtype) -> tuple[list[int], frozenset]:
    """(bytes of each value a boundary into a block carries behind the hidden state, one
    micro-batch of ``b`` rows; the trace's blocks). Which keywords cross is the trace's; their
    sizes are estimated as the runtime lays them out for DeepStack (Qwen3-VL, the one family that
    has them): the layout header, the image-token mask as bytes, and one level per
    ``deepstack_visual_indexes`` entry of one image's tokens per row at the decoder's width. A
    model that carries nothing: ([], its blocks)."""
    # the config first: tracing a model's forward costs seconds on a 70B-405B one, and only a
    # model whose config names DeepStack levels can carry any
    levels = len(getattr(getattr(getattr(model, "config", None), "vision_config", None),
                         "deepstack_visual_indexes", None) or ())
    trace = trace_forward(model) if levels and spine_for(model) is None else None
    if trace is None or not trace.carried:
        return [], frozenset()
    blocks = frozenset(trace.blocks)
    hidden = model.config.get_text_config().hidden_size
    level = b * image_inputs(model).per_image * hidden * torch.empty((), dtype=dtype).element_size()
    return [CARRIED_HEADER_BYTES, b * seq] + [level] * levels, blocks


def carried_rank_rows(model: nn.Module, cuts: list[str], stage_to_rank, b: int, seq: int, m: int,
                      dtype) -> list[list[Collective]]:
    """Per pipeline rank, the P2P of the values a decoder's forward makes from the tower's output
    and stages carry behind the hidden state (forward_split.ForwardStage, carried.py): across every
    boundary whose next stage starts at a block, per micro-batch, forward and backward (the runtime
    returns a gradient, zeros where none, for every tensor a stage received), ``carried_sizes``
    each."""
    p = max(stage_to_rank) + 1
    sizes, blocks = carried_sizes(model, b, seq, dtype)
    rows: list[list[Collective]] = [[] for _ in range(p)]
    if not sizes:
        return rows
    for s, cut in enumerate(cuts):   # the boundary between stage s and s + 1
        a, z = stage_to_rank[s], stage_to_rank[s + 1]
        if cut not in blocks or a == z:
            continue
        for rank in (a, z):
            rows[rank] += [Collective("send_recv", phase, n, m, "pp") for n in sizes for phase in ("forward", "backward")]
    return rows


def plan_tower(search, best, model_inputs: list[str], module: str, group: str, styles: dict,
               memory_limit: float = math.inf, placement: str | None = None) -> tuple[dict, list[list[Collective]]]:
    """(the plan's ``pipeline.preprocess`` entry, per-rank extra collectives -- empty unless MPipe
    is chosen). Schedules with several stages per rank are placed with MPipe unpriced (the
    placement pricing needs one stage per rank) and say so in the entry."""
    c = best.choice
    units, p2p = search.unit_costs(best.dp, best.pp, best.tp, best.dp_mode, best.recompute, best.b)
    tower = tower_units(search, best, group)
    meta = search.meta
    tower_mod = tower_module(meta, module)
    reduce = (local_tower_bytes(tower_mod, module, styles, best.tp) if module != METHOD
              else _side_bytes(meta, styles, best.tp))
    ctx = search.ctx(best.dp, best.pp, best.tp, best.dp_mode, best.recompute)
    reduce_s = sum(ctx.topology.collective_time("pp", "all_reduce", b) for b in reduce.values())
    entry = {"module": module, "inputs": list(model_inputs), "into": INTO if module != METHOD else IMAGE_INTO,
             "owner_placement": "front"}
    if module == METHOD:
        own, keep = tower_inputs(meta, list(model_inputs))
        entry.update(inputs=own + keep, keep=keep)
    runs = runnable_placements(module)
    if placement is not None and placement not in runs:
        raise InvalidConstraintError(f"plan_cluster: constraints['tower_placement']={placement!r}: the runtime runs "
                                     f"{list(runs)} for tower {module!r}")
    runs = (placement,) if placement is not None else runs
    if schedule_facts(c.schedule).stages_per_rank(c.v) == 1 and tower:
        choices = choose_tower_placement(tower, units, c.p, c.m, c.schedule, p2p_time=p2p,
                                         tower_reduce_s=reduce_s, memory_limit=memory_limit)
        # the fastest placement the runtime runs; the others stay priced (in ``choices``, fastest
        # first) so the plan says when one of them would be faster (add_tower's note)
        pick = next((ch.placement for ch in choices if ch.placement in runs and ch.fits),
                    next(ch.placement for ch in choices if ch.placement in runs))
        entry.update(placement=pick, choices=[ch.to_dict() for ch in choices])
    else:
        if placement not in (None, "mpipe"):
            raise InvalidConstraintError(f"plan_cluster: constraints['tower_placement']={placement!r} needs a schedule "
                                         f"with one stage per rank; {c.schedule} has several (only mpipe places it)")
        entry.update(placement="mpipe", choices=[])
    ir = schedule_facts(c.schedule).ir(c.p, c.m, c.v)
    tp_rows = tower_tp_rows(search, best, module, group)
    if entry["placement"] != "mpipe":   # stage 0 runs every micro-batch's tower
        rows = [[] for _ in range(c.p)]
        rows[ir.stage_to_rank[0]] = [col.scaled(c.m) for col in tp_rows]
        return entry, rows
    seq = search.seq
    out = tower_outputs(meta, module, best.b, seq, search.dtype)
    dp_dim = "dp" if best.dp > 1 and best.dp_mode == "fsdp" else None
    rows = mpipe_rank_rows(ir, out, list(reduce.values()), dp_dim)
    owned = Counter(preprocess_owner(ir.stage_to_rank, mb) for mb in range(c.m))
    return entry, [r + [col.scaled(owned[rank]) for col in tp_rows if owned[rank]] for rank, r in enumerate(rows)]


def add_tower(pipeline: dict, styles: dict, model: nn.Module, search, best,
              placement: str | None = None) -> tuple[dict, list[str]]:
    """A pipelined plan's ``pipeline`` section with a VL model's ``preprocess`` entry and each
    rank's MPipe collectives, and the notes that say why (the section unchanged and no notes for a
    model without a tower or a plan without a pipeline). ``placement``: the user's constraint, else
    the fastest the runtime runs. Returns new values; the assembler writes them into the plan."""
    c = best.choice
    if c.p <= 1 or not pipeline:
        return pipeline, []
    meta = search.meta
    found = find_tower(meta, search.graph(best.b), search.unit_names)
    if found is None:
        return pipeline, []
    module, group = found
    tokens = torch.zeros(best.b, search.seq, dtype=torch.long, device="meta")
    inputs = sorted(k for k in image_inputs(meta)(tokens) if k != "input_ids")
    entry, rows = plan_tower(search, best, inputs, module, group, styles, search.limit, placement)
    notes = []
    fastest = entry["choices"][0] if entry.get("choices") else None
    if fastest is not None and fastest["placement"] != entry["placement"]:
        mine = next((ch for ch in entry["choices"] if ch["placement"] == entry["placement"]), None)
        theirs = f"{fastest['step_s']:.4g} s"
        ours = f"{mine['step_s']:.4g} s" if mine else "not priced to fit"
        why = ("as constraints['tower_placement'] asks" if placement is not None else
               f"the fastest placement the runtime runs for this model ({sorted(runnable_placements(module))})")
        runs = fastest["placement"] in runnable_placements(module)
        notes.append(f"vision tower {module}: placed with {entry['placement']}, {why}; {fastest['placement']} is "
                     f"priced faster ({theirs} vs {ours} per step)" + ("" if runs else " but has no runtime yet"))
    log.info("vision tower %s: placement %s (%s)", module, entry["placement"],
             [(ch["placement"], ch["step_s"]) for ch in entry["choices"]])
    carried = carried_rank_rows(meta, list(pipeline.get("cuts") or []), schedule_facts(c.schedule).ir(
        c.p, c.m, c.v).stage_to_rank, best.b, search.seq, c.m, search.dtype)
    rank_collectives = [merged_rows([Collective.from_row(x) for x in old] + extra + more)
                        for old, extra, more in zip(pipeline["rank_collectives"], rows, carried)]
    priced = ", ".join(f"{ch['placement']} {ch['step_s']:.4g} s{'' if ch['fits'] else ' (does not fit)'}"
                       for ch in entry["choices"]) or "not priced (several stages per rank)"
    notes.append(f"vision tower {module!r} ({group}): placement {entry['placement']}; priced placements, fastest "
                 f"first: {priced}")
    return dict(pipeline, preprocess=entry, rank_collectives=rank_collectives), notes
