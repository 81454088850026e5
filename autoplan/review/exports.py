"""Export a Plan for other tools: torch-native styles, HF ``tp_plan`` strings, a Python snippet.

A plan reviewed here may be run elsewhere: with plain ``torch.distributed.tensor.parallel``
(``to_torch``), with HF transformers' ``tp_plan`` (``to_hf_tp_plan``; only the styles HF can
name, and the export says which entries it could not express and why, rather than dropping
them silently), or as a few lines of Python a person can read and paste (``to_python``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from autoplan.errors import AutoplanError
from hyper_parallel import style_from_dict
from hyper_parallel.core.tensor_parallel import match_modules, to_torch_plan

# HF ParallelInterface names (v5, and v4 where it differs), see shared/reference/expert_plans.json "hf/_styles"
_HF_NAMES = {
    "v5": {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather": "colwise_gather_output",
           "rowwise_split": "rowwise_split_input", "embedding_rowwise": "embedding_rowwise",
           "sequence_parallel": "sequence_parallel"},
    "v4": {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather": "colwise_rep",
           "rowwise_split": "rowwise_rep", "embedding_rowwise": None, "sequence_parallel": "sequence_parallel"},
}


def _styles(plan_or_styles) -> dict[str, dict[str, Any]]:
    """{pattern: style dict} from a Plan, a dict of style dicts or a dict of ParallelStyle objects."""
    styles = getattr(plan_or_styles, "styles", plan_or_styles)
    return {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in styles.items()}


def to_torch(plan, model: nn.Module | None = None) -> dict[str, Any]:
    """{pattern: torch.distributed.tensor.parallel style} for torch's ``parallelize_module``.

    ``model`` resolves module-dependent defaults (an embedding's token ids are Replicate here,
    Shard(-1) in torch), so pass it when you have it. The result applies with
    ``torch.distributed.tensor.parallel.parallelize_module(model, mesh[plan.tp_dim], result)``.
    """
    return to_torch_plan({k: style_from_dict(v) for k, v in _styles(plan).items()}, model)


@dataclass
class HFExport:
    """HF transformers tensor-parallel plan strings.

    ``tp_plan`` uses the plan's full module patterns (what ``model._tp_plan``-style code matches),
    ``base_model_tp_plan`` the same entries relative to the base model (``base_model_prefix``
    stripped, what goes into a config), and ``not_expressible`` maps every pattern HF cannot name
    to the reason, so a reviewer knows what running the HF plan would lose.
    """

    tp_plan: dict[str, str]
    base_model_tp_plan: dict[str, str]
    not_expressible: dict[str, str] = field(default_factory=dict)
    omitted: dict[str, str] = field(default_factory=dict)   # no-op annotations HF does not need

    @property
    def complete(self) -> bool:
        return not self.not_expressible


def _hf_kind(spec: dict[str, Any], is_embedding: bool) -> tuple[str | None, str]:
    """(HF kind key, reason if none) for one style dict."""
    style, args = spec["style"], dict(spec.get("args", {}))
    if args.pop("use_local_output", True) is False:
        return None, "keeps a DTensor output (loss parallel); HF styles return plain tensors"
    if style == "PrepareHeadsInput":
        return None, "sets the module's head counts to their local values; HF has no such style (its plans " \
                     "for these models gather the projection output instead)"
    if style == "PrepareLatentInput":
        return None, "all-reduces the gradient of the columns a latent attention broadcasts to every head " \
                     "(MLA's rotary key); HF has no such style"
    if args.get("packed", 1) != 1:
        return None, f"{args['packed']} packed projections, each rank its slice of every one, have no HF name"
    if style == "ColwiseParallel":
        inp, out = args.pop("input_layouts", None), args.pop("output_layouts", None)
        if args or inp not in (None, "Replicate()"):
            return None, f"column-wise with input {inp} (sequence-parallel input) has no HF name"
        if out in (None, "Shard(-1)"):
            return "colwise", ""
        if out == "Replicate()":
            return "colwise_gather", ""
        return None, f"column-wise with output {out} has no HF name"
    if style == "RowwiseParallel":
        inp, out = args.pop("input_layouts", None), args.pop("output_layouts", None)
        if args or out not in (None, "Replicate()"):
            return None, f"row-wise with output {out} (reduce-scatter to a sequence shard) has no HF name"
        if is_embedding:
            return ("embedding_rowwise", "") if inp in (None, "Replicate()") else (None, f"embedding input {inp}")
        if inp in (None, "Shard(-1)"):
            return "rowwise", ""
        if inp == "Replicate()":
            return "rowwise_split", ""
        return None, f"row-wise with input {inp} has no HF name"
    if style == "SequenceParallel":
        # the gradient reduction (when in backward) is no layout: HF's name covers both
        rest = {k: v for k, v in args.items() if k != "reduce_grads"}
        return ("sequence_parallel", "") if not rest else (None, f"SequenceParallel{rest} has no HF name")
    return None, f"{style} (a layout change between modules) has no HF name; HF inserts none"


def to_hf_tp_plan(plan, model: nn.Module | None = None, *, version: str = "v5",
                  base_model_prefix: str | None = None) -> HFExport:
    """HF ``tp_plan`` strings for every style HF can express (``version`` "v5" or "v4" names)."""
    if version not in _HF_NAMES:
        raise AutoplanError(f"to_hf_tp_plan: version must be one of {sorted(_HF_NAMES)}, got {version!r}")
    names = _HF_NAMES[version]
    if base_model_prefix is None:
        base_model_prefix = getattr(model, "base_model_prefix", None) or "model"
    out, base, missing, omitted = {}, {}, {}, {}
    for pattern, spec in _styles(plan).items():
        args = spec.get("args", {})
        if spec["style"] == "PrepareModuleInput" and args.get("input_layouts") == args.get("desired_input_layouts") \
                and not args.get("input_kwarg_layouts"):
            omitted[pattern] = "input already in the desired layout (an annotation only)"
            continue
        is_emb = False
        if model is not None:
            m = match_modules(model, pattern)
            is_emb = bool(m) and isinstance(m[0][1], nn.Embedding)
        else:
            is_emb = pattern.rsplit(".", 1)[-1] in ("embed_tokens", "tok_embeddings", "wte", "word_embeddings")
        kind, why = _hf_kind(spec, is_emb)
        name = names.get(kind) if kind else None
        if name is None:
            missing[pattern] = why or f"{kind} has no name in HF {version}"
            continue
        out[pattern] = name
        if pattern.startswith(base_model_prefix + "."):
            base[pattern[len(base_model_prefix) + 1:]] = name
    return HFExport(dict(sorted(out.items())), dict(sorted(base.items())), dict(sorted(missing.items())),
                    dict(sorted(omitted.items())))


def _py(value: Any) -> str:
    """Python source for a style argument: placements stay as written ("Shard(1)"), lists become tuples."""
    if isinstance(value, str) and (value.startswith("Shard(") or value == "Replicate()" or value.startswith("Partial")):
        return value
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def style_source(spec: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={_py(v)}" for k, v in spec.get("args", {}).items())
    return f"{spec['style']}({args})"


def to_python(plan) -> str:
    """A readable, runnable snippet that reproduces the plan's parallelization with hyper_parallel.

    It builds the mesh, applies the styles on the tp dimension, wraps blocks and the root with
    FSDP2 on the dp dimension when the plan does, and trains under loss parallel when chosen.
    ``model`` and ``device_type`` are the snippet's free names.
    """
    styles = _styles(plan)
    mesh = getattr(plan, "mesh", None) or {"shape": [1], "names": ["tp"]}
    tp_dim = getattr(plan, "tp_dim", "tp")
    used = sorted({s["style"] for s in styles.values()})
    placements = sorted({p for p in ("Shard", "Replicate", "Partial")
                         if any(p + "(" in str(s) for s in styles.values())})
    fsdp = bool(getattr(plan, "fsdp", {}).get("enabled"))
    lines = ["# generated by autoplan.review.to_python -- the plan's parallelization, as code",
             "from hyper_parallel import init_device_mesh, parallelize_module" + (", fully_shard" if fsdp else ""),
             "from hyper_parallel import " + ", ".join(used + placements),
             "",
             f"mesh = init_device_mesh(device_type, {tuple(mesh['shape'])}, mesh_dim_names={tuple(mesh['names'])})",
             "tp_plan = {"]
    lines += [f"    {pattern!r}: {style_source(spec)}," for pattern, spec in styles.items()]
    lines += ["}", f"parallelize_module(model, mesh, tp_plan, mesh_dim={tp_dim!r})"]
    if fsdp:
        dp = plan.fsdp.get("dim") or plan.dp_dim
        # packed (strided) weights are FSDP-sharded on their other dimension, as plan.apply does
        packed = any((s.get("args") or {}).get("packed", 1) != 1 for s in styles.values())
        kw = ", shard_placement_fn=fsdp_shard_placement" if packed else ""
        if packed:   # ... and a packed projection's bias stays replicated over dp (fsdp_unshardable)
            kw += ", ignored_params=replicated"
            lines.insert(3, "from hyper_parallel.core.dtensor import fsdp_shard_placement, fsdp_unshardable")
            lines.append("replicated = set(fsdp_unshardable(model))  # average their gradients over dp after "
                         "backward")
        prefixes = sorted({d["block_prefix"] for d in plan.decisions if d.get("block_prefix") is not None})
        block_kw = kw + (", reshard_after_forward=False" if plan.fsdp.get("reshard_after_forward") is False else "")
        for prefix in prefixes:
            lines += [f"for block in model.get_submodule({prefix!r}).children():",
                      f"    fully_shard(block, mesh=mesh[{dp!r}]{block_kw})"]
        if plan.fsdp.get("prefetch"):
            lines.append(f"# then each block.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch with "
                         f"the {plan.fsdp['prefetch']} block(s) after / before it")
        lines.append(f"fully_shard(model, mesh=mesh[{dp!r}]{kw})")
    pipe = getattr(plan, "pipeline", None)
    if pipe and int(pipe.get("pp", 1)) > 1:
        lines += [f"# pipeline: pp={pipe['pp']}, schedule {pipe.get('schedule')}, "
                  f"{pipe.get('microbatches')} micro-batches, cuts before {pipe.get('cuts')};",
                  "# split the model at those cuts (hyper_parallel PipelineStage + the schedule) before the lines "
                  "above, or use plan.apply(model, mesh), which does it"]
    if getattr(plan, "activation_checkpointing", False):
        lines.append("# the plan checkpoints every repeated block's activations "
                     "(torch.distributed._composable.checkpoint)")
    if getattr(plan, "loss_parallel", False):
        lines += ["# logits stay vocabulary-sharded: compute the loss inside hyper_parallel.loss_parallel()"]
    return "\n".join(lines) + "\n"
