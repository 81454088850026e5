"""The planner units of mixers beside attention and MLP: a mixture-of-experts layer and a
state-space (Mamba) mixer, each read from its roles entry (capture's dataflow), and the structure
a TP search sees when experts are planned elsewhere (by expert parallelism)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from autoplan.capture.ir import ModelGraph
from autoplan.search.units.work import Work


@dataclass
class MoeUnit:
    """A mixture-of-experts layer recognised from its dataflow (router -> top-k -> expert weights,
    roles.py): its container, the experts module holding 3-D (stacked) expert weights, and the
    expert ffn width F their tensor-parallel split cuts."""
    rel: str                    # the MoE container, relative to the block
    experts: str                # the experts module, relative to the block
    num_experts: int
    top_k: int
    ffn: int
    work: Work = field(default_factory=Work)          # the router's and the experts'
    expert_work: Work = field(default_factory=Work)   # the experts module's share of ``work``
    flat: bool = False          # experts as flat (E * F, H) weights (DBRX): FlatExpertsParallel splits them
    # flat experts: routing-weight bytes over hidden-state bytes of their call, (num, den) (None: not read)
    routing_weights: tuple[int, int] | None = None
    paired: dict | None = None  # experts as an up and a down module of 3-D weights (JetMoE): PairedExpertsParallel's args


@dataclass
class MambaUnit:
    """A state-space (Mamba) mixer (roles ``mamba``): its module relative to the block, its inner
    channel count, the modules inside it whose outputs are last whole before the per-channel scan
    (Jamba's dt/B/C norms: MambaMixerParallel's ``replicated_after``) and the bytes of its x_proj
    output per call (all-reduced in forward and backward when its channels are split)."""
    rel: str
    channels: int
    after: list[str]
    xproj_bytes: int
    work: Work = field(default_factory=Work)
    after_bytes: list[int] = field(default_factory=list)   # each ``after`` module's output bytes per call
    # a Mamba-2 mixer (no x_proj): in_proj's and conv1d's weights stay whole (their packed parts differ in
    # width), each rank computing its rows; each of these parameters' gradients (bytes) is all-reduced in
    # backward, one all-reduce per parameter as DTensor issues them
    whole_param_bytes: list[int] = field(default_factory=list)


MAMBA_NOT_A_UNIT = ("a state-space (Mamba) mixer directly in the block, or a second one in it: only one mixer per "
                    "block, in a module of its own, is planned; it stays replicated")


def mamba_unit(graph: ModelGraph, rep: str, x: dict, work) -> MambaUnit:
    """The planner unit of a Mamba mixer (roles ``mamba`` entry). Whether its code is a layout
    MambaMixerParallel splits (Mamba-1 on its channels, Mamba-2 on its heads) is the style's check,
    run by the probe."""
    where = f"{rep}.{x['module']}"
    after = sorted(f[len(where) + 1:] for f, info in graph.modules.items()
                   if f.startswith(where + ".") and info.role == "mamba.part" and info.params
                   and all(len(s) == 1 for s in info.params.values()))
    def out_bytes(fqn: str) -> int:   # the last op of the module: its output
        nodes = [n for n in graph.nodes if n.module == fqn and n.outputs]
        return nodes[-1].outputs[0].nbytes if nodes else 0

    whole: list[int] = []
    if f"{where}.x_proj" not in graph.modules:   # Mamba-2: in_proj and conv1d kept whole
        own = work(where)
        per = own.param_bytes / max(own.params, 1)
        whole = [int(math.prod(shape) * per) for f in (f"{where}.in_proj", f"{where}.conv1d") if f in graph.modules
                 for shape in graph.modules[f].params.values()]
    return MambaUnit(x["module"], int(x.get("channels") or 0), after, out_bytes(f"{where}.x_proj"), work(where),
                     [out_bytes(f"{where}.{a}") for a in after], whole)


# why a TP search without MoE units leaves the experts alone: on a mesh with an ep dimension the
# expert plan (expert_plan) splits them by expert parallelism; with context parallelism they stay
# whole (mesh.search.experts_tp). On a mesh with tp and neither, they are TP units (experts_tp).
MOE_NOT_A_TP_UNIT = ("a mixture-of-experts layer: planned by expert parallelism over the ep dimension, or kept whole "
                     "with context parallelism")


def without_moe_units(st):
    """``st`` with its MoE layers as no tensor-parallel unit (see ``MOE_NOT_A_TP_UNIT``), the TP
    search keeping its stream away from them."""
    blocks, not_units = [], list(st.not_units)
    for b in st.blocks:
        if b.moe is not None:
            not_units.append((f"{b.representative}.{b.moe.rel}" if b.moe.rel else b.representative,
                              MOE_NOT_A_TP_UNIT))
            b = dataclasses.replace(b, moe=None, other_work=b.other_work + b.moe.work)
        blocks.append(b)
    return dataclasses.replace(st, blocks=blocks, not_units=not_units)


def moe_unit(graph: ModelGraph, rep: str, e: dict, work) -> MoeUnit | str:
    """The planner unit of a MoE layer (roles "moe" entry), or why it is none: tensor parallelism
    splits each expert on its ffn width, which needs the experts as 3-D weights."""
    if e.get("flat_params") and e.get("experts"):
        experts = work(f"{rep}.{e['experts']}")
        return MoeUnit(e["module"], e["experts"], int(e["num_experts"]), int(e.get("top_k") or 1), int(e["ffn"]),
                       work(f"{rep}.{e['router']}") + experts, experts, flat=True,
                       routing_weights=tuple(e["routing_weights"]) if e.get("routing_weights") else None)
    if e.get("paired"):
        where, pair = f"{rep}.{e['experts']}", e["paired"]   # the container is the experts module: its whole work
        return MoeUnit(e["module"], e["experts"], int(e["num_experts"]), int(e.get("top_k") or 1), int(e["ffn"]),
                       work(where), work(f"{where}.{pair['up']}") + work(f"{where}.{pair['down']}"),
                       paired=dict(pair))
    if not e.get("expert_params") or not e.get("experts"):
        return "its experts are a list of modules, not 3-D weights (split them with expert parallelism on an ep " \
               "dimension)"
    info = graph.modules.get(f"{rep}.{e['experts']}")
    down = info.params.get("down_proj") if info else None
    if down is None or len(down) != 3 or "gate_up_proj" not in info.params:
        return "its expert weights are not the stacked gate_up_proj / down_proj the expert styles split"
    gate_up = info.params["gate_up_proj"]
    ffn = next((d for d in down[1:] if 2 * d in gate_up[1:]), 0)
    if not ffn:
        return f"its expert ffn width could not be read from gate_up_proj {gate_up} / down_proj {down}"
    experts = work(f"{rep}.{e['experts']}")
    # the router and the experts (a shared expert in the same container is the block's MLP unit)
    return MoeUnit(e["module"], e["experts"], int(e.get("num_experts") or down[0]), int(e.get("top_k") or 1), ffn,
                   work(f"{rep}.{e['router']}") + experts, experts)
