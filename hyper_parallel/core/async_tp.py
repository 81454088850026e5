"""Async tensor parallelism: sequence-parallel collectives fused with the matmuls beside them.

Under sequence parallelism every tensor-parallel region starts with an all-gather of the
sequence-sharded activations and ends with a reduce-scatter of the partial outputs, each on the
critical path between two GEMMs. torch hides them the way torchtitan runs it: inductor's
micro-pipeline TP pass (``torch._inductor.fx_passes.micro_pipeline_tp``) rewrites
``all_gather -> mm`` into ``symm_mem.fused_all_gather_matmul`` and ``mm -> reduce_scatter`` into
``symm_mem.fused_matmul_reduce_scatter``, which split the GEMM into one chunk per TP rank and move
the next chunk over NVLink (symmetric memory, copy engines) while the current one multiplies.

So async TP is a setting of the compile step, not a style: :func:`enable_async_tp` turns the
pass on for the TP group (symmetric memory on that group, inductor's flag), and
:func:`fused_matmul_collectives` runs torch's own pass on a captured graph to count what it fuses
-- which works on any machine, so verify can check that our styles produce the patterns the pass
fuses even where the fused kernels cannot run (CPU, gloo).
"""
from __future__ import annotations

import contextlib
import copy
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
import torch.fx

from hyper_parallel.errors import AsyncTPError

FUSED_OPS = {"fused_all_gather_matmul": "all_gather", "fused_all_gather_scaled_matmul": "all_gather",
             "fused_matmul_reduce_scatter": "reduce_scatter", "fused_scaled_matmul_reduce_scatter": "reduce_scatter"}


def async_tp_blockers(tp_mesh) -> list[str]:
    """Why async TP cannot run on ``tp_mesh`` here (empty: it can): the fused kernels exist for
    CUDA devices with NCCL and symmetric memory only."""
    out = []
    if tp_mesh is None or tp_mesh.size() < 2:
        out.append("the plan has no tensor-parallel dimension of size >= 2 to overlap")
        return out
    if tp_mesh.device_type != "cuda":
        out.append(f"the mesh is on {tp_mesh.device_type!r}; the fused all-gather/reduce-scatter matmuls run on "
                   "CUDA devices only")
    backend = dist.get_backend(tp_mesh.get_group())
    if backend != "nccl":
        out.append(f"the tp group's backend is {backend!r}; symmetric memory needs NCCL")
    if not dist.is_nccl_available():
        out.append("this torch build has no NCCL")
    return out


def enable_async_tp(tp_mesh, where: str = "async_tp") -> None:
    """Turn on inductor's micro-pipeline TP pass for the TP group of ``tp_mesh`` (before the
    model's first compiled call), or raise :class:`AsyncTPError` naming every blocker."""
    blockers = async_tp_blockers(tp_mesh)
    if blockers:
        raise AsyncTPError(f"{where}: async tensor parallelism cannot run here: " + "; ".join(blockers)
                           + ". Apply the plan with async_tp off (it can still be priced with it on)")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group   # CUDA builds only
    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@contextlib.contextmanager
def _pass_can_run():
    """Let torch's pass rewrite a graph on a machine without NCCL or symmetric memory: its own
    test mode answers "enabled" for every group, and its NCCL gate (a check of the machine, not
    of the graph) is opened. Nothing runs the rewritten graph."""
    from torch.distributed._symmetric_memory import _test_mode
    with _test_mode(), mock.patch.object(dist, "is_nccl_available", return_value=True):
        yield


def fused_matmul_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """What inductor's post-grad passes with micro-pipeline TP make of ``gm`` (a forward or
    backward graph as AOT autograd hands it to inductor): ``{"all_gather": n, "reduce_scatter": n}``
    fused collectives, ``"matmuls"``: the GEMMs inside them, and ``"left"``: all-gathers and
    reduce-scatters the pass left unfused. Runs on a copy; needs the process group the graph's
    collectives name to exist (a real or fake one)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
    from torch._inductor.virtualized import V

    gm = copy.deepcopy(gm)
    fake = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if "val" in n.meta])
    with _pass_can_run(), inductor_config.patch(_micro_pipeline_tp=True), V.set_fake_mode(fake), \
            (fake or contextlib.nullcontext()):
        view_to_reshape(gm)
        post_grad_passes(gm, is_inference=False)
    out: Counter = Counter({"all_gather": 0, "reduce_scatter": 0, "matmuls": 0, "left": 0})
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in FUSED_OPS:
            out[FUSED_OPS[name]] += 1
            b = node.args[1]
            out["matmuls"] += len(b) if isinstance(b, (list, tuple)) and FUSED_OPS[name] == "all_gather" else 1
        elif name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            out["left"] += 1
    return dict(out)
