"""Context parallelism: the sequence of every sample sharded over the cp dimension for the whole model.

Plan section ``parallel.cp``: null (no context parallelism; the mesh's cp dimension, if any, has
size 1), or ``dim`` (the mesh's cp dimension), ``variant`` ("ring": K/V passed around the cp ring
with batched P2P, each exchange overlapped with one attention block; "allgather": K/V gathered
once, one reduce-scatter of their gradients), ``degree`` and what the planner priced
(``exchange_s``: the attention exchange per step, ``exposed_s``: the part compute cannot hide).

The runtime is ``hyper_parallel.core.context_parallel``: the ``ContextParallel`` style on the
model's root (applied after tensor parallel, torchtitan's order TP -> CP -> AC -> FSDP), the
load-balanced batch shard (``shard_batch``: every rank a head and a tail chunk of 2*cp), and
``cp_cross_entropy`` (the exact mean over the global batch). Gradients are averaged over the cp
ranks together with the dp ranks: FSDP2 shards over the flattened dp x cp mesh, as torchtitan
folds cp into FSDP (``autoplan.parallelisms.data.grad_mesh``), or over cp alone when the plan has no
dp dimension; without FSDP one flat all-reduce over that mesh.
"""
from __future__ import annotations

import torch

from autoplan.errors import InvalidArgumentError
from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from hyper_parallel import cp_cross_entropy
from hyper_parallel.core.context_parallel import VARIANTS, apply_context_parallel, local_positions, shard_batch
from hyper_parallel.core.context_parallel.style import _position_arg

_D = "#/$defs/"


def cp_section(plan) -> dict | None:
    """The plan's ``parallel.cp`` section (None: no context parallelism)."""
    return plan.parallel.get("cp")


def cp_mesh(plan, mesh):
    """The 1-D cp sub-mesh of ``mesh`` for ``plan`` (None without context parallelism)."""
    section = cp_section(plan)
    if not section or section["dim"] not in tuple(mesh.mesh_dim_names or ()):
        return None
    sub = mesh[section["dim"]]
    return sub if sub.size() > 1 else None


def cp_share(inputs: torch.Tensor, targets: torch.Tensor, mesh):
    """This rank's head and tail chunks of whole-sequence ``inputs``/``targets`` on the 1-D cp
    ``mesh`` (unchanged when ``mesh`` is None). Positions are filled in by the style's hook."""
    if mesh is None:
        return inputs, targets
    tokens, tgt, _ = shard_batch(mesh, inputs, targets)
    return tokens, tgt


def cp_step_kwargs(model, mesh, local_len: int) -> dict:
    """What a pipelined cp step passes every stage (``kwarg_specs`` NO_SPLIT): the global positions
    of this rank's head and tail chunks -- ``positions`` (1-D) for the repo Llama, ``position_ids``
    (1, S/cp) for transformers -- since the style's hook on the root does not run inside stages.
    Empty without cp (``mesh`` None)."""
    if mesh is None:
        return {}
    cp, rank = mesh.size(), mesh.get_local_rank()
    pos = local_positions(local_len * cp, cp, rank)
    return {"positions": pos} if cp_step_key(model) == "positions" else {"position_ids": pos.unsqueeze(0)}


def cp_step_key(model) -> str:
    """The keyword of ``cp_step_kwargs`` for ``model`` (the root before the pipeline cut)."""
    return "positions" if _position_arg(model) == "positions" else "position_ids"


class ContextParallelism(Parallelism):
    """Registry entry ``cp``: the ContextParallel style on the whole model, after tensor parallel."""

    name = "cp"
    roles = ("cp",)
    order = 20   # after tp (10), before ac (30) and FSDP (40)
    schema = {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["dim", "variant"], "additionalProperties": False,
        "properties": {"dim": {"$ref": _D + "name"}, "variant": {"enum": sorted(VARIANTS)},
                       "degree": {"$ref": _D + "positive"}, "exchange_s": {"$ref": _D + "seconds"},
                       "exposed_s": {"$ref": _D + "seconds"}}}]}

    def check(self, section, data, roles, degree) -> None:
        if not self.check_own_dim(section, roles, degree, "a plan on a cp dimension must say how its attention "
                                  "runs (dim, variant)"):
            return
        name = roles.get("cp")
        size = degree.get(name, 1) if name else 1
        if size < 2:
            raise section_error("cp", "dim", f"{name}={size}: context parallelism needs a cp dimension of size >= 2 "
                                "(use null for none)")
        if section.get("degree") not in (None, size):
            raise section_error("cp", "degree", f"{section['degree']} but the mesh's {name} has {size} ranks")
        seq = data["batch"].get("seq_len")
        if seq is not None and seq % (2 * size):
            raise section_error("cp", "dim", f"sequence length {seq} is not divisible by 2*cp = {2 * size} (the "
                                "load-balanced layout cuts it into 2*cp equal chunks)")
        if data["parallel"].get("hsdp"):
            raise section_error("cp", "", "context parallelism with HSDP is not supported (FSDP folds cp into the "
                                "1-D dp x cp mesh); use a single dp dimension")
        names = list(degree)
        dp = data["parallel"]["dp"]["dim"]
        if dp is not None and names.index(dp) + 1 != names.index(name):
            raise section_error("cp", "dim", f"the dp dimension {dp!r} must sit right before {name!r} in the mesh "
                                f"names {names}: gradients average over the flattened dp x cp mesh")

    def share_batch(self, applied: dict, inputs, targets, who: str):
        """This rank's head and tail chunks of every sequence (after the row splits)."""
        return cp_share(inputs, targets, applied.get("cp_mesh"))

    def step_loss(self, applied: dict, loss_fn, who: str):
        """The token cross entropy's exact mean over the global batch, reduced over the gradient
        mesh (dp x cp, or cp alone), with the gradient scaled for the averaging that follows."""
        mesh = applied.get("cp_mesh")
        if mesh is None:
            return None
        if loss_fn is not None:
            name = getattr(loss_fn, "__name__", loss_fn)
            raise InvalidArgumentError(f"{who}: loss_fn={name!r} with context parallelism; the loss of a cp plan is "
                                       "the token cross entropy over the global batch (cp_cross_entropy); omit loss_fn")
        over = applied.get("dp_mesh") if applied.get("dp_mesh") is not None else mesh

        def cp_loss(logits, targets):
            return cp_cross_entropy(logits, targets, over)
        return cp_loss

    def stage_kwargs(self, applied: dict, root, inputs) -> dict | None:
        mesh = applied.get("cp_mesh")
        return cp_step_kwargs(root, mesh, inputs.shape[1]) if mesh is not None else None

    def stage_kwarg_keys(self, applied: dict, root) -> tuple[str, ...]:
        return (cp_step_key(root),) if applied.get("cp_mesh") is not None else ()

    def apply_to_model(self, plan, target: ApplyTarget) -> None:
        """The ContextParallel style on the model's root, after tensor parallel's styles; the cp
        sub-mesh in ``state["cp_mesh"]`` for the runner's batch shard and loss."""
        sub = cp_mesh(plan, target.mesh) if self.active(plan) else None
        target.state["cp_mesh"] = sub
        if sub is not None:
            section = cp_section(plan)
            apply_context_parallel(target.model, target.mesh, cp_dim=section["dim"], variant=section["variant"])
