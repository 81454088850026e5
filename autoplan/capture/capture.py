"""capture(): model + example inputs or batch spec -> ModelGraph, on meta, one trace per distinct block.

Order of attempts: export with each block group cut to its representative (fast: the cost does
not grow with depth); export of the full model (a model that indexes its layers by count);
export with fake CPU tensors instead of meta (a forward that creates tensors without a device);
for a model with image inputs, export on fake CPU weights with inputs that hold values (a tower
that filters images by content, a decoder indexing by a mask of image tokens, sizes made from
Python ints: torch's real-tensor propagation measures them; ``fake.py``); forward hooks (a model
export cannot trace), on meta then on fake CPU tensors. Each step down logs a warning naming why.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autoplan.capture.blocks import assign_blocks, find_blocks, module_tree, only_representatives, type_name
from autoplan.capture.fake import fake_device, tracing
from autoplan.capture.fallback import capture_with_hooks
from autoplan.capture.image_inputs import inputs_with_values, is_vision_language, value_checks_off
from autoplan.capture.patch_grid import has_real_sizes, sizes_from_values
from autoplan.capture.quiet import quiet_torch
from autoplan.capture.graph_cache import graph_key, load_graph, store_graph
from autoplan.capture.inputs import DEFAULT_MAX_COPY_BYTES, meta_view, resolve_inputs
from autoplan.capture.ir import ModelGraph
from autoplan.capture.opcost import register_flop_formulas
from autoplan.capture.roles import recognise_roles
from autoplan.capture.trace import export, to_nodes
from autoplan.errors import AutoplanError, CaptureError

log = logging.getLogger(__name__)
_DATA_DEPENDENT = "data-dependent tensor sizes"


def capture(
    model: nn.Module,
    inputs: Any = None,
    *,
    batch: Any = None,
    dtype: torch.dtype | None = None,
    max_copy_bytes: int | None = DEFAULT_MAX_COPY_BYTES,
    dedupe_blocks: bool = True,
    fallback: bool = True,
) -> ModelGraph:
    """Capture ``model`` as a ModelGraph without touching real weights.

    Args:
        model: an ``nn.Module`` on meta (used in place, restored afterwards) or on a real device
            (copied to meta; parameters are not copied).
        inputs: example inputs: a tensor, a tuple of positional args, a dict of keyword args, or
            ``(args, kwargs)``. Only shapes and dtypes are used.
        batch: instead of inputs, a batch spec: ``(batch_size, seq_len)``, a dict or a
            :class:`~autoplan.capture.inputs.BatchSpec`; token ids (or images for vision models)
            are made on meta.
        dtype: cast floating parameters and inputs to this dtype first (e.g. ``torch.bfloat16``).
        max_copy_bytes: largest real-device model copied to meta; above it ModelTooLargeError.
        dedupe_blocks: trace one representative per block group (False traces every layer; the IR
            still keeps one representative per group).
        fallback: when export fails, capture with module hooks instead of raising.

    Raises:
        MissingInputsError: neither ``inputs`` nor ``batch``.
        ModelTooLargeError: a real-device model over ``max_copy_bytes``.
        CaptureError: the model does not run even eagerly on meta, or ``fallback=False`` and export failed.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture(model=...): expected an nn.Module, got {type(model).__name__}")
    args, kwargs = resolve_inputs(model, inputs, batch, dtype)
    register_flop_formulas()
    # a graph an earlier process captured from the same model, inputs and code (graph_cache)
    key = graph_key(model, args, kwargs, dtype=dtype, max_copy_bytes=max_copy_bytes, dedupe_blocks=dedupe_blocks,
                    fallback=fallback)
    graph = load_graph(key)
    if graph is None:
        graph = _capture_model(model, args, kwargs, dtype, max_copy_bytes, dedupe_blocks, fallback)
        if not graph.warnings:   # a fallback's warnings are logged by capturing: such a graph is not kept
            store_graph(key, graph)
    return graph


def _capture_model(model: nn.Module, args: tuple, kwargs: dict, dtype, max_copy_bytes, dedupe_blocks: bool,
                   fallback: bool) -> ModelGraph:
    with meta_view(model, dtype, max_copy_bytes) as mm, quiet_torch():
        modes = [(m, m.training) for m in mm.modules()]
        mm.train()  # training-time graph: dropout present, caches off
        try:
            # a VL model's image-token count check has no values on meta; its image grid has
            with value_checks_off(mm, every_family=True), sizes_from_values(kwargs):
                return _capture_meta(mm, args, kwargs, dedupe_blocks, fallback)
        except AutoplanError:
            raise
        except Exception as exc:  # a torch error escaping every attempt: typed, naming model and error
            raise CaptureError(f"capture of {type_name(mm)} failed: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        finally:
            for m, training in modes:
                m.training = training


def _capture_meta(mm: nn.Module, args: tuple, kwargs: dict, dedupe: bool, fallback: bool) -> ModelGraph:
    infos, tied, nparams = module_tree(mm)
    groups = find_blocks(mm)
    assign_blocks(infos, groups)
    root_type = type_name(mm)
    shorten = bool(dedupe and groups)
    attempts = [("export", True, "meta")] if shorten else []
    attempts += [("export-full", False, "meta"), ("export-fake", shorten, "fake")]
    if is_vision_language(mm) or callable(getattr(mm, "extra_inputs", None)):
        # sizes the inputs' values decide (an image filter, a token mask)
        attempts.append(("export-values", shorten, "values"))
    errors: list[str] = []
    for method, short, where in attempts:
        if errors and errors[-1].startswith(_DATA_DEPENDENT) and where != "values":
            continue  # an export without values sees the same data-dependent sizes
        keep = where == "values"
        valued = inputs_with_values(mm, kwargs) if keep else kwargs
        if valued is None:
            continue
        mode = None
        try:
            with contextlib.ExitStack() as stack:
                rename = stack.enter_context(only_representatives(mm, groups)) if short else {}
                a, kw = args, kwargs
                if where != "meta":  # tensors the forward creates land on the CPU: be there too, as fakes
                    mode, a, kw = stack.enter_context(fake_device(mm, args, valued, keep_values=keep))
                    stack.enter_context(tracing(mode, keep))
                ep = export(mm, a, kw)
        except Exception as exc:
            msg = f"{method} of {root_type} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log.debug("%s", msg)   # one attempt of several: the outcome is said by the caller
            errors.append(msg)
            continue
        try:
            # the graph's sizes read the values measured
            with tracing(mode, keep) if keep else contextlib.nullcontext():
                return graph_of_export(ep, rename, groups, root_type, (infos, tied, nparams), method, errors)
        except GuardOnDataDependentSymNode as exc:  # MoE routing by data-dependent counts (JetMoE)
            msg = f"{_DATA_DEPENDENT} in the {method} of {root_type} ({str(exc).splitlines()[0]})"
            log.debug("%s", msg)
            errors.append(msg)
    if not fallback:
        raise CaptureError("; ".join(errors))
    try:
        graph = capture_with_hooks(mm, args, kwargs, infos, groups, tied, nparams, errors)
    except CaptureError as exc:
        if has_real_sizes(kwargs):   # fake CPU copies would lose the sizes: this error is the reason
            raise
        errors.append(str(exc))
        log.debug("hooks on meta failed (%s); retrying with fake CPU tensors", exc)
        with fake_device(mm, args, kwargs) as (_, a, kw):
            graph = capture_with_hooks(mm, a, kw, infos, groups, tied, nparams, errors)
    _own_tied_names(graph.nodes, tied)
    recognise_roles(graph)
    return graph


def graph_of_export(ep, rename: dict[str, str], groups, root_type: str, tree: tuple, method: str,
                    errors: list[str]) -> ModelGraph:
    """The ModelGraph of an exported program: nodes and edges from its (current) node values,
    the module tree ``tree`` = (infos, tied, number of parameters) of the traced model, roles."""
    infos, tied, nparams = tree
    nodes, edges, gin, gout = to_nodes(ep, rename, groups, root_type)
    _own_tied_names(nodes, tied)
    graph = ModelGraph(model_type=root_type, nodes=nodes, edges=edges, modules=infos, blocks=groups,
                       tied_parameters=tied, inputs=gin, outputs=gout, method=method, warnings=list(errors),
                       num_parameters=nparams)
    recognise_roles(graph)
    return graph


def _own_tied_names(nodes, tied: list[list[str]]) -> None:
    """Export names a tied parameter once (any of its FQNs); name it after the module using it."""
    group_of = {name: g for g in tied for name in g}
    for n in nodes:
        fixed = []
        for src in n.input_nodes:
            if src.startswith("param:") and src[6:] in group_of:
                own = next((f for f in group_of[src[6:]] if f.rpartition(".")[0] == n.module), src[6:])
                src = f"param:{own}"
            fixed.append(src)
        n.input_nodes = fixed
        n.params = sorted({s[6:] for s in fixed if s.startswith("param:")})
