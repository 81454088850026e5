"""Tensor (and sequence) parallelism: per-module hyper_parallel styles on the tp dimension.

Plan section ``parallel.tp``: ``dim`` (the mesh's tp dimension or null), ``styles`` (module
pattern -> style data from hyper_parallel's registry), ``stream_layout`` (R: replicated residual
stream; S: sequence parallel) and ``loss_parallel`` (vocabulary-parallel cross-entropy). Applied
first, to the whole model (a pipeline is cut from the styled model).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard

from autoplan.errors import PlanSchemaError
from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from hyper_parallel import ColwiseParallel, ParallelStyle, SequenceParallel, parallelize_module, style_from_dict
from hyper_parallel.core.tensor_parallel import match_modules

_STYLE = {"type": "object", "required": ["style", "args"], "additionalProperties": False,
          "properties": {"style": {"type": "string"}, "args": {"type": "object"}}}


class TensorParallel(Parallelism):
    name = "tp"
    roles = ("tp",)
    order = 10
    schema = {"type": "object", "required": ["dim", "styles", "stream_layout", "loss_parallel"],
              "additionalProperties": False,
              "properties": {"dim": {"type": ["string", "null"]},
                             "styles": {"type": "object", "additionalProperties": _STYLE},
                             "stream_layout": {"enum": ["R", "S"]},
                             "loss_parallel": {"type": "boolean"}}}

    def default(self) -> dict:
        return {"dim": None, "styles": {}, "stream_layout": "R", "loss_parallel": False}

    def check(self, section, data, roles, degree) -> None:
        if section["dim"] is not None and section["dim"] != roles.get("tp"):
            raise section_error("tp", "dim", f"{section['dim']!r} is not the mesh's tp dimension (mesh names "
                                f"{list(degree)}; expected {roles.get('tp')!r} or null)")
        if section["dim"] is None and (section["styles"] or section["stream_layout"] == "S"
                                       or section["loss_parallel"]):
            raise section_error("tp", "dim", "null, but the plan has tensor-parallel styles, a sequence-parallel "
                                "stream or loss parallel; they would be silently skipped when applied")
        for pattern in section["styles"]:
            if pattern and any(not atom for atom in pattern.split(".")):
                raise section_error("tp", "styles", f"{pattern!r} is not a module pattern (empty name between dots)")

    def active(self, plan) -> bool:
        return bool(plan.styles) and plan.tp_dim is not None

    def apply_to_model(self, plan, target: ApplyTarget) -> None:
        """The styles on the whole model (before a pipeline split, so every stage's layouts
        agree); ``state["tp_mesh"]``: the sub-mesh activations live on (None: no tensor parallel).
        A tp dimension of size 1 is no tensor parallelism: nothing is styled."""
        names = tuple(target.mesh.mesh_dim_names or ())
        tp_mesh = target.mesh[plan.tp_dim] if plan.tp_dim in names else None
        target.state["tp_mesh"] = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        if self.active(plan) and target.state["tp_mesh"] is not None:
            styles = runner_styles(plan.styles)
            check_embedding_outputs(plan, target.model, styles)
            parallelize_module(target.model, target.mesh, styles, mesh_dim=plan.tp_dim, strict=True)


def stream_embeddings(plan, model: nn.Module) -> set[str]:
    """The embeddings whose output is the residual stream: the plan's ``embedding`` unit, and the
    model's own input embedding where it names one (``get_input_embeddings``, as transformers'
    models do). Other embedding tables (T5's position-bias table, sharded on its heads) are not."""
    names = {d.get("module") for d in plan.decisions if d.get("unit") == "embedding" and d.get("module")}
    get = getattr(model, "get_input_embeddings", None)
    table = get() if callable(get) else None
    if isinstance(table, nn.Module):
        names |= {fqn for fqn, m in model.named_modules() if m is table}
    return names


def check_embedding_outputs(plan, model: nn.Module, styles: dict[str, ParallelStyle]) -> None:
    """Refuse a column-wise stream embedding whose output stays sharded on the hidden dimension.

    ``ColwiseParallel`` on an ``nn.Embedding`` shards its embedding dimension and, by default,
    returns each rank's slice of the hidden features. The stream embedding feeds the residual
    stream, which a plan holds whole per token (replicated, or sharded on the sequence): every
    module after it would read a hidden size of ``dim / tp`` and fail deep inside the first
    forward with an untyped shape error. A hand-written plan is checked here, before anything
    changes."""
    stream = stream_embeddings(plan, model)
    for pattern, style in styles.items():
        out = getattr(style, "output_layouts", None)
        if not (isinstance(style, ColwiseParallel) and isinstance(out, Shard) and out.dim in (-1, 2)):
            continue
        for fqn, module in match_modules(model, pattern):
            if isinstance(module, nn.Embedding) and fqn in stream:
                raise PlanSchemaError(
                    f"plan.parallel.tp.styles[{pattern!r}]: ColwiseParallel on the embedding {fqn!r} leaves its "
                    f"output sharded on the hidden dimension ({out}), but the residual stream it feeds is whole per "
                    "token; use RowwiseParallel(input_layouts=Replicate()) (vocabulary-parallel), or "
                    "ColwiseParallel(output_layouts=Replicate()) / (output_layouts=Shard(1)) for a sequence-sharded "
                    "stream")


def runner_styles(styles: dict[str, dict]) -> dict[str, ParallelStyle]:
    """{pattern: style} from a plan's style dicts, as autoplan's runners apply them: every
    SequenceParallel reduces its weight gradients in backward (``reduce_grads=True``), whatever the
    plan file says, because the planner's collective counts, verify's dry run and the pipeline's
    weight pass assume each gradient carries its parameter's layout when backward ends (torch's
    default, kept by hyper_parallel, leaves them Partial for the optimizer)."""
    out = {}
    for pattern, spec in styles.items():
        style = style_from_dict(spec)
        if isinstance(style, SequenceParallel) and not style.reduce_grads:
            style = SequenceParallel(sequence_dim=style.sequence_dim, use_local_output=style.use_local_output,
                                     reduce_grads=True)
        out[pattern] = style
    return out
