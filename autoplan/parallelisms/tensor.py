"""Tensor (and sequence) parallelism: per-module hyper_parallel styles on the tp dimension.

Plan section ``parallel.tp``: ``dim`` (the mesh's tp dimension or null), ``styles`` (module
pattern -> style data from hyper_parallel's registry), ``stream_layout`` (R: replicated residual
stream; S: sequence parallel) and ``loss_parallel`` (vocabulary-parallel cross-entropy). Applied
first, to the whole model (a pipeline is cut from the styled model).
"""
from __future__ import annotations

from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from hyper_parallel import ParallelStyle, SequenceParallel, parallelize_module, style_from_dict

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
            parallelize_module(target.model, target.mesh, runner_styles(plan.styles),
                               mesh_dim=plan.tp_dim, strict=True)


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
