"""What both dry runs share (dry_run.py for one mesh, pipeline_dry_run.py per pipeline rank):
the result type, the meta copy of the model in the plan's dtype, one dp rank's fake batch and
the local shard of a parameter. Apart from either so that the single-mesh verify can hand
pipelined plans to the pipeline dry run without the two importing each other.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autoplan.capture.inputs import meta_model
from autoplan.errors import AutoplanError
from autoplan.parallelisms.registry import traffic_owners
from autoplan.plan.plan import Plan


KEY = ["kind", "mesh_dim", "phase", "bytes"]


def mesh_groups(mesh, names) -> dict[str, list[str]]:
    """{process group name: the mesh dimensions that run on it}, the named ones first, then the
    flattened ones the plan made (FSDP over dp x cp or dp x ep). Several can share one group: at
    dp 1 the flattened dp x ep is the ep group itself."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(mesh.get_group(n).group_name, []).append(n)
    for n, m in getattr(mesh, "_flatten_mapping", {}).items():
        dims = out.setdefault(m.get_group().group_name, [])
        if n not in dims:
            dims.append(n)
    return out


def named_events(events: list[dict], groups: dict[str, list[str]], plan: Plan, other: str | None = None) -> list[dict]:
    """Each issued collective with the mesh dimension it ran on. Where dimensions share its group
    the ranks cannot tell them apart, so it is the one the plan predicts a collective of that kind,
    phase and size on (any pipeline rank's), else the first; a group of no dimension is ``other``
    (default ``group:<name>``)."""
    pipe = plan.pipeline or {}
    predicted = list(plan.predictions.get("collectives", [])) + [r for rows in pipe.get("rank_collectives", [])
                                                                  for r in rows]
    keys = {(r["kind"], r["mesh_dim"], r["phase"], r["bytes"]) for r in predicted}
    out = []
    for e in events:
        dims = groups.get(e["group"]) or [other or f"group:{e['group']}"]
        out.append(dict(e, mesh_dim=next((d for d in dims if (e["kind"], d, e["phase"], e["bytes"]) in keys), dims[0])))
    return out


@dataclass
class VerifyResult:
    collectives: pd.DataFrame     # KEY + parallelism, predicted, issued, match
    param_bytes: dict[str, int]   # predicted / issued per rank (rank 0)
    passed: bool
    numerics: object | None = None  # NumericsResult when verify(numerics=True)
    error: str | None = None        # the plan failed to apply or run in the dry run
    async_tp: object | None = None  # AsyncTPCheck of a plan priced with overlap="async_tp" (or why not checked)

    def mismatches(self) -> pd.DataFrame:
        return self.collectives[~self.collectives["match"]]


def compare(plan: Plan, predicted_rows: list[dict], issued: pd.DataFrame, key: list[str] = KEY) -> pd.DataFrame:
    """Predicted rows against issued counts by ``key`` (the pipeline dry run leaves the phase
    out), each row named by the parallelism that owns
    its mesh dimension (``autoplan.parallelisms``). A row matches when the counts agree and its
    dimension belongs to a parallelism the plan uses: traffic on any other dimension is wrong
    even if predicted."""
    pred = pd.DataFrame(predicted_rows)
    if pred.empty:
        pred = pd.DataFrame(columns=key + ["count"])
    pred = pred.groupby(key)["count"].sum().reset_index(name="predicted")
    df = pred.merge(issued, on=key, how="outer").fillna({"predicted": 0, "issued": 0})
    df["predicted"] = df["predicted"].astype(int)
    df["issued"] = df["issued"].astype(int)
    df["parallelism"] = df["mesh_dim"].map(traffic_owners(plan)).fillna("none")
    df["match"] = (df["predicted"] == df["issued"]) & (df["parallelism"] != "none")
    return df.sort_values(key).reset_index(drop=True)


def meta_copy(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    out = meta_model(model, dtype)
    return copy.deepcopy(out) if out is model else out


def plan_dtype(plan: Plan) -> torch.dtype:
    if (plan.fsdp or {}).get("mixed_precision"):
        return torch.float32   # parameters are fp32 master weights; the FSDP policy casts for compute
    name = str(plan.batch.get("dtype", "torch.float32")).replace("torch.", "")
    return getattr(torch, name)


def compute_dtype(plan: Plan) -> torch.dtype:
    """The dtype activations have at run time: FSDP mixed precision computes in its param_dtype
    (what a pipeline stage sends on), else the plan's dtype."""
    mp = (plan.fsdp or {}).get("mixed_precision")
    if mp:
        return getattr(torch, str(mp.get("param_dtype", "float32")).replace("torch.", ""))
    return plan_dtype(plan)


def dry_fake_mode() -> FakeTensorMode:
    """The dry runs' fake mode: static shapes, with a shape environment all the same, because
    torch's fake ``nonzero`` -- behind every boolean index -- refuses to run without one even where
    the mask's count is known. OwnRouting gives that count from the mask's value (the image-token
    mask of the token ids the dry run built: Qwen3-VL's DeepStack add), so every size stays a
    number; a size no value decides is still refused there."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(allow_scalar_outputs=False),
                          static_shapes=True)


def dry_batch(plan: Plan, ways: int, inputs=None):
    """(inputs, targets) of the plan's whole global batch, for ``runner.local_batch`` to share out
    exactly as a step does: token ids of the plan's batch shape, or -- given ``inputs``, one rank's
    rows -- those rows repeated ``ways`` times (the batch shards, ``registry.batch_shards``), so a
    rank's share has their shape. Call under FakeTensorMode, and under OwnRouting: the token ids
    then carry their values (zeros, the image tokens a VL model's inputs place), so a mask made of
    them has a known count."""
    if inputs is None:
        gb, seq = plan.batch.get("global_batch"), plan.batch.get("seq_len")
        if not gb or not seq:
            raise AutoplanError("verify: the plan has no batch shape; pass inputs=")
        inputs = torch.zeros(gb // ways * ways, seq, dtype=torch.long)
    else:
        inputs = inputs.repeat(ways, *([1] * (inputs.dim() - 1)))
    return inputs, torch.zeros(inputs.shape, dtype=torch.long)


def local_part(p):
    """This rank's shard of a DTensor parameter (a plain tensor is its own)."""
    return p.to_local() if hasattr(p, "to_local") else p
