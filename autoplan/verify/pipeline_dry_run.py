"""verify for pipelined plans (pp > 1): every pipeline rank's issued collectives vs the plan's.

Same method as dry_run.py (fake process group at the plan's world size, meta model,
FakeTensorMode, CollectiveRecorder), once per pipeline rank r: the fake group is initialised as
the global rank at mesh coordinate (pp=r, every other dim 0), the plan is applied with
apply_pipeline_plan, r's stages get fake storage, one warm-up step runs unrecorded, then one
recorded step. Compared exactly per (kind, mesh dim, bytes) with counts against
``plan.pipeline["rank_collectives"][r]``: TP collectives of r's stages (on the last stage with
loss parallel: the vocabulary-parallel loss's, never a full-vocabulary gather), FSDP per unit,
the P2P sends and receives of its stage boundaries and the runtime's signature all-reduce, expert
parallel's all-to-alls (under balanced routing, as dry_run.py) and its gradient all-reduce over ep; with an
MPipe tower (``pipeline.preprocess``) also the transposed tower outputs and their gradients (P2P)
and the tower-gradient all-reduce, run with the tower inputs ``model.extra_inputs(tokens)`` gives.

Boundary shapes: the runtime learns them at its first step by an exchange between pipeline ranks
that a fake group cannot carry (a later stage would receive nothing). The dry run computes them
in-process instead (``local_boundaries``: a second meta copy with the plan's TP layouts, every
stage run in order under FakeTensorMode) and hands them to the schedule as ``boundary_metas``,
so every schedule -- GPipe, 1F1B, Interleaved1F1B, ZeroBubble, ZBV -- is dry-run on every rank.

What is not compared: the phase (forward/backward interleave in a pipeline step and the
recorder's phase marker only follows autograd), and which group a P2P op ran on (the recorder
does not name the group of send/recv or of the signature all-reduce; they are attributed to
pp, the only group the schedule talks on). Parameter bytes per rank are compared exactly.
"""
from __future__ import annotations

import logging

import pandas as pd
import torch
from torch.distributed.device_mesh import init_device_mesh

from autoplan.capture.image_inputs import value_checks_off
from autoplan.errors import AutoplanError
from autoplan.parallelisms import ApplyTarget, parallelism
from autoplan.parallelisms.registry import batch_shards
from autoplan.plan.pipeline_runner import microbatch_image_inputs, rank_parameters
from autoplan.verify.dry_common import (VerifyResult, compare, compute_dtype, dry_batch, dry_fake_mode, local_part,
                                       mesh_groups, meta_copy, named_events, plan_dtype)
from hyper_parallel.core.pipeline_parallel import ImageFeatures, split_microbatches
from hyper_parallel.core.pipeline_parallel.image_features import METHOD
from hyper_parallel.core.pipeline_parallel.stage import flatten
from hyper_parallel.core.pipeline_parallel.shape_inference import local_boundaries
from hyper_parallel import balanced_routing
from hyper_parallel.local.own_routing import OwnRouting
from hyper_parallel.local import CollectiveRecorder, fake_world

log = logging.getLogger(__name__)
KEY = ["kind", "mesh_dim", "bytes"]


def _global_rank(plan, pp_rank: int) -> int:
    """Global rank at mesh coordinate pp=pp_rank, 0 on every other dimension (row-major mesh)."""
    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    rank = 0
    for size, name in zip(shape, names):
        rank = rank * size + (pp_rank if name == "pp" else 0)
    return rank


def _image_inputs(plan, model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(token ids, the step's image keywords) as PipelineRunner.step derives them for a plan with a
    vision tower (per micro-batch); ``tokens`` and none without one. Every pipeline rank passes
    them: stage 0 or any MPipe owner runs the tower, every stage may read the token ids."""
    if not ((plan.pipeline or {}).get("preprocess") or {}).get("placement"):
        return tokens, {}
    return microbatch_image_inputs(model, tokens, int(plan.pipeline["microbatches"]))


def issued_pipeline_collectives(plan, model: torch.nn.Module, inputs=None, pp_rank: int = 0,
                                boundaries: dict | None = None) -> tuple[pd.DataFrame, int]:
    """(issued collectives by KEY with counts, parameter bytes) of pipeline rank ``pp_rank``.

    ``boundaries``: a dict shared across calls; the boundary descriptions are computed on the
    first call and reused (they are the same for every pipeline rank)."""
    boundaries = {} if boundaries is None else boundaries
    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    world = 1
    for s in shape:
        world *= s
    meta = meta_copy(model, plan_dtype(plan))
    # boundaries as the runtime infers them: stage outputs in the dtype the stages compute in
    shapes_model = None if "metas" in boundaries else meta_copy(model, compute_dtype(plan))
    with fake_world(world, rank=_global_rank(plan, pp_rank)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        runner = plan.apply(meta, mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
        # the named dimensions and the flattened ones the plan runs on (FSDP over dp x cp / dp x ep)
        groups = mesh_groups(mesh, names)
        pre = runner.schedule.preprocess   # an MPipe plan's tower: on every rank, outside the stages
        pbytes = sum(local_part(p).numel() * local_part(p).element_size() for p in rank_parameters(runner.stages, pre))
        tp_mesh = None
        if shapes_model is not None:   # the same tensor- and expert-parallel styles, on the copy that infers shapes
            shaped = ApplyTarget(model=shapes_model, mesh=mesh, pipelined=True)
            parallelism("tp").apply_to_model(plan, shaped)
            parallelism("ep").apply_to_model(plan, shaped)
            tp_mesh = shaped.state.get("tp_mesh")
        fake = dry_fake_mode()
        with fake:
            for st in runner.stages:
                st.module.to_empty(device="cpu")
            if pre is not None:
                pre.module.to_empty(device="cpu")
            if shapes_model is not None:
                shapes_model.to_empty(device="cpu")
        # MoE: a fixed balanced routing, so the all-to-all sizes are the predicted ones (a model's own
        # expert loop indexing by its routing mask, DBRX's: the balanced values, OwnRouting)
        # shapes only: transformers' checks of input values have none to read (VL models' image-token
        # counts), and the derived inputs are consistent by construction
        with fake, balanced_routing(), OwnRouting(), value_checks_off(meta, every_family=True):
            # rank 0's share of the global batch, as a step takes it (rows, then sequence chunks)
            inputs, targets = runner.local_batch(*dry_batch(plan, batch_shards(plan), inputs))
            inputs, extra = _image_inputs(plan, meta, inputs)
            step_kwargs = runner.step_kwargs(inputs)
            if shapes_model is not None:
                m = int(plan.pipeline["microbatches"])
                # micro-batch 0's keywords, split as the schedule splits the step's
                mb_args, mb_kwargs = split_microbatches((inputs,), {**step_kwargs, **extra}, m, None,
                                                        runner.schedule.kwarg_specs)
                if pre is not None:   # stage 0 takes micro-batch 0's tower output (the dry run's own tower)
                    mb0 = mb_kwargs[0]
                    tower_kw = {k: mb0[k] for k in pre.inputs}
                    for k in set(pre.inputs) - set(pre.keep):
                        mb0.pop(k)
                    module = plan.pipeline["preprocess"]["module"]
                    tower = ImageFeatures(shapes_model) if module == METHOD else shapes_model.get_submodule(module)
                    out = tower(**tower_kw)
                    # unpacked by the tower that just ran: it knows how its output is laid out
                    mb0[pre.into] = tower.unpack(flatten(out, "tower")) if pre.unpack else out
                boundaries["metas"] = local_boundaries(shapes_model, list(plan.pipeline["cuts"]), tp_mesh,
                                                       mb_args[0], mb_kwargs[0], device="cpu")
            runner.schedule.boundary_metas = boundaries["metas"]
            args = (inputs,) if runner.first else ()
            tgt = targets if runner.last else None
            runner.schedule.step(*args, target=tgt, **step_kwargs, **extra)   # warm-up: FSDP lazy init, caches
            with CollectiveRecorder() as rec:
                runner.schedule.step(*args, target=tgt, **step_kwargs, **extra)
                runner.data_parallel_step()   # replicated dp's all-reduce / ZeRO-1, as PipelineRunner.step
    rows = named_events(rec.events, groups, plan, other="pp")
    df = pd.DataFrame(rows, columns=["kind", "bytes", "mesh_dim"])
    issued = df.groupby(KEY).size().reset_index(name="issued") if len(df) else pd.DataFrame(columns=KEY + ["issued"])
    return issued, int(pbytes)


def verify_pipeline(plan, model: torch.nn.Module, inputs=None, ranks=None) -> VerifyResult:
    """Dry-run every pipeline rank of ``plan`` (or only ``ranks``); ``passed`` only when every
    rank's (kind, dim, bytes) counts and parameter bytes agree exactly. The collectives table
    has a ``pp_rank`` column; ``param_bytes`` holds {predicted, issued} of the rank with the most
    predicted bytes (the fullest rank, as ``predictions.memory_bytes``) and ``per_rank`` for each."""
    pipe = plan.pipeline
    p = int(pipe["pp"])
    per_rank = pipe.get("rank_collectives")
    if not per_rank or len(per_rank) != p:
        raise AutoplanError(
            f"verify: plan.pipeline has no rank_collectives for its {p} pipeline ranks (got "
            f"{0 if not per_rank else len(per_rank)}); re-plan with this autoplan (plan_cluster writes them)")
    want_bytes = pipe.get("rank_param_bytes") or [None] * p
    ranks = range(p) if ranks is None else list(ranks)
    tables, pbytes, passed, boundaries = [], {}, True, {}
    for r in ranks:
        if not 0 <= r < p:
            raise AutoplanError(f"verify: ranks= holds {r}; valid pipeline ranks are 0..{p - 1}")
        issued, got = issued_pipeline_collectives(plan, model, inputs, r, boundaries)
        df = compare(plan, per_rank[r], issued, KEY)
        want = int(want_bytes[r]) if want_bytes[r] is not None else got
        passed = passed and bool(df["match"].all()) and want == got
        tables.append(df.assign(pp_rank=r))
        pbytes[r] = {"predicted": want, "issued": got}
        log.info("verify pipeline rank %d/%d: %d rows, match=%s", r, p, len(df), bool(df["match"].all()))
    table = pd.concat(tables, ignore_index=True)[["pp_rank"] + KEY + ["parallelism", "predicted", "issued", "match"]]
    fullest = max(pbytes, key=lambda r: (pbytes[r]["predicted"], -r))
    return VerifyResult(table, dict(pbytes[fullest], per_rank=pbytes), passed)
