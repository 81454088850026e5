"""Plans in the runtime modes the cost model prices (ZeRO-1, selective recomputation, mixed
precision), made the way plan_cluster makes them: autoplan() then autoplan.assembler's modes."""
from __future__ import annotations

import torch

from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.assembler import with_dp_mode, with_mixed_precision, with_recompute
from autoplan.search.units.structure import model_structure


def mode_plan(model, shape, names, batch, *, dp_mode="replicate", recompute="none", dtype=torch.float32,
              mixed_precision=False, **opts):
    """A plan for ``model`` on ``shape``/``names`` in ``dp_mode`` with ``recompute``."""
    dp = dict(zip(names, shape)).get("dp", 1)
    graph = capture(model, None, batch=(batch[0] // dp, batch[1]), dtype=dtype)
    st = model_structure(graph)
    plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=batch, dtype=dtype, graph=graph,
                    fsdp=dp_mode == "fsdp", activation_checkpointing=recompute == "full", **opts)
    plan = with_dp_mode(plan, graph, st, dp_mode, 8 + (4 if st.dtype_bytes < 4 else 0))
    plan = with_recompute(plan, st, recompute)
    return with_mixed_precision(plan) if mixed_precision else plan
