"""What one parallelism is to this project: the contract every registry entry fulfils.

A parallelism (tensor, data, hybrid-sharded data, pipeline, activation recomputation, and next
expert and context parallel) is one object that owns, in one file:

1. the mesh dimensions it occupies (``ParallelDims`` roles),
2. its section of a plan file: a JSON-schema fragment and the checks one field cannot make alone
   (``schema``, ``check``), so a plan stores decisions per parallelism instead of fixed fields,
3. how the runtime applies it on this rank (``apply_to_model`` before a pipeline split,
   ``apply_to_roots`` after it, in the registry's order: TP -> CP -> AC -> FSDP, PP around them),
4. its part of a training step on this rank: the rows or sequence chunk of a batch it keeps
   (``batch_ways``, ``share_batch``), a loss it must replace (``step_loss``) and the gradient work
   it adds between backward and the optimizer (``after_backward``) -- so both runners and verify's
   dry runs walk the registry instead of naming parallelisms,
5. the mesh dimensions whose traffic verify attributes to it (``traffic_dims``).

The planner's candidates for a parallelism are priced by ``autoplan.search`` from the runtime's own
styles (collectives derived from the styles hyper_parallel applies, checked by the probe).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.nn as nn

from autoplan.errors import PlanSchemaError
from hyper_parallel.parallel_dims import mesh_roles


@dataclass
class ApplyTarget:
    """What a plan's parallelisms are applied to on this rank.

    ``model``: the whole model (tensor parallel applies here, before any pipeline split);
    ``roots``: the modules data parallel wraps last -- ``[model]``, or this rank's pipeline stages;
    ``blocks``: the repeated blocks inside the roots (recomputation and FSDP units);
    ``ignored_params``: parameters FSDP must leave alone (tied across pipeline stages);
    ``state``: what entries hand each other and the runner (``tp_mesh``, ``dp_mesh``, ``dp_mode``).
    """

    model: nn.Module
    mesh: Any
    roots: list[nn.Module] = field(default_factory=list)
    # the blocks, or a function finding them: looked up only by an entry that uses them (a plan
    # without recomputation or FSDP applies to a model that lacks the plan's block container;
    # whatever checks the model -- e.g. a checkpoint load -- then says so)
    block_finder: Callable[[], list[nn.Module]] | list[nn.Module] = field(default_factory=list)
    ignored_params: set = field(default_factory=set)
    pipelined: bool = False
    state: dict = field(default_factory=dict)

    @property
    def blocks(self) -> list[nn.Module]:
        if callable(self.block_finder):
            self.block_finder = list(self.block_finder())
        return self.block_finder


class Parallelism:
    """One registry entry. Subclasses set the class attributes and override what they use."""

    name: ClassVar[str]                   # the plan section's key, e.g. "tp"
    roles: ClassVar[tuple[str, ...]] = ()  # ParallelDims roles it occupies ("tp",); () for none
    order: ClassVar[int]                  # application order (smaller first)
    schema: ClassVar[dict]                # JSON schema of its plan section (null allowed when unused)
    optional: ClassVar[bool] = False      # a plan file may omit the section (added after schema 3: null)

    # -- plan section ------------------------------------------------------------------------
    def default(self) -> dict | None:
        """The section of a plan that does not use this parallelism."""
        return None

    def check(self, section: dict | None, data: dict, roles: dict[str, str], degree: dict[str, int]) -> None:
        """Consistency of this section with the rest of the plan (mesh, other sections); raise
        PlanSchemaError naming the field. ``roles``: {role: mesh name}; ``degree``: {mesh name: size}."""

    def check_own_dim(self, section, roles: dict[str, str], degree: dict[str, int], needs: str = "") -> bool:
        """For an entry that owns one mesh dimension (its first role): a null section only where the
        mesh lacks that dimension or has it of size 1 (``needs`` says what the section would give);
        otherwise ``dim`` must name it. Returns False for a null section (nothing more to check)."""
        role = self.roles[0]
        name = roles.get(role)
        size = degree.get(name, 1) if name else 1
        if section is None:
            if size > 1:
                raise section_error(self.name, "", f"null, but the mesh has {name}={size}" + (f"; {needs}" if needs else ""))
            return False
        if section["dim"] != name:
            raise section_error(self.name, "dim", f"{section['dim']!r} is not the mesh's {role} dimension (mesh names "
                                f"{list(degree)}; expected {name!r})")
        return True

    def active(self, plan) -> bool:
        """Whether ``plan`` uses this parallelism."""
        return bool(plan.parallel.get(self.name))

    # -- runtime ---------------------------------------------------------------------------
    def apply_to_model(self, plan, target: ApplyTarget) -> None:
        """Applied to the whole model, before a pipeline split (tensor parallel)."""

    def apply_to_roots(self, plan, target: ApplyTarget) -> None:
        """Applied to ``target.roots`` / ``target.blocks`` after the split (recompute, FSDP)."""

    # -- a training step on this rank (the runners and verify's dry runs walk these) ------------
    def batch_ways(self, plan) -> int:
        """Ways this parallelism splits the rows of a global batch (1: it does not split rows)."""
        return 1

    def share_batch(self, applied: dict, inputs: torch.Tensor, targets: torch.Tensor, who: str):
        """This rank's part of ``inputs``/``targets`` along what this parallelism splits (batch rows,
        or each sequence), from what its apply step left in ``applied`` (``ApplyTarget.state``);
        unchanged by default. ``who`` names the caller in errors."""
        return inputs, targets

    def step_loss(self, applied: dict, loss_fn: Callable | None, who: str) -> Callable | None:
        """A loss this parallelism needs instead of the caller's (context parallel's exact mean over
        the global batch), or None to keep it. ``loss_fn``: the caller's own loss, None for the
        runner's default; one this parallelism cannot honour is refused here, before any step."""
        return None

    def stage_kwargs(self, applied: dict, root: nn.Module, inputs: torch.Tensor) -> dict | None:
        """Keywords every pipeline stage needs in a step because this parallelism changed what the
        stage's input alone tells it (context parallel's global positions), passed whole to every
        micro-batch; None: nothing to add."""
        return None

    def stage_kwarg_keys(self, applied: dict, root: nn.Module) -> tuple[str, ...]:
        """The names :meth:`stage_kwargs` returns, known before the schedule is built (it passes
        them whole instead of splitting them into micro-batches)."""
        return ()

    def after_backward(self, applied: dict, optimizer) -> bool:
        """Gradient work between the step's last backward and the optimizer step (an all-reduce
        the runtime issues itself); True when it stepped ``optimizer`` itself (ZeRO-1)."""
        return False

    # -- verify -----------------------------------------------------------------------------
    def traffic_dims(self, plan) -> tuple[str, ...]:
        """Mesh dimension names whose collectives this parallelism issues in ``plan`` (only when
        it is active: a tp dimension of size 1 in a plan without styles carries nothing)."""
        if not self.active(plan):
            return ()
        roles = mesh_roles(plan.mesh["names"])
        return tuple(roles[r] for r in self.roles if r in roles)


def section_error(name: str, key: str, message: str) -> PlanSchemaError:
    """A PlanSchemaError for field ``parallel/<name>/<key>``."""
    path = f"parallel/{name}" + (f"/{key}" if key else "")
    return PlanSchemaError(f"plan field {path}: {message}")
