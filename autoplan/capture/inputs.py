"""Example inputs on meta: from a batch spec, or from the user's tensors, and the model's meta copy.

Capture never runs on real weights: a meta model is used as is, a model on a real device is
copied to meta by deep-copying its module objects while mapping every parameter and buffer to an
empty meta tensor (weights are not copied). Tensors held outside parameters and buffers would be
copied for real, which is why a size limit guards the copy.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from autoplan.capture.image_inputs import SIZE_INPUTS, image_inputs, param_dtype
from autoplan.errors import CaptureError, MissingInputsError, ModelTooLargeError

DEFAULT_MAX_COPY_BYTES = 8 * 2**30


@dataclass(frozen=True)
class BatchSpec:
    """Shape of one training batch: ``batch_size`` sequences of ``seq_len`` tokens.

    ``decoder_seq_len`` is for encoder-decoder models (defaults to ``seq_len``); ``image_size``
    for vision models (defaults to the model config's ``image_size``).
    """

    batch_size: int
    seq_len: int = 1
    decoder_seq_len: int | None = None
    image_size: int | None = None

    @classmethod
    def coerce(cls, batch: Any) -> "BatchSpec":
        if isinstance(batch, BatchSpec):
            return batch
        if isinstance(batch, int):
            return cls(batch)
        if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 2:
            return cls(*[int(b) for b in batch])
        if isinstance(batch, dict):
            return cls(**batch)
        raise CaptureError(
            f"batch={batch!r}: expected BatchSpec, (batch_size, seq_len) or a dict of its fields"
        )


def _forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def inputs_from_batch(model: nn.Module, batch: Any, dtype: torch.dtype | None = None):
    """(args, kwargs) of meta tensors for ``model`` from a batch spec.

    Vision models (``main_input_name == "pixel_values"``) get images, encoder-decoder models
    also get decoder tokens, every other model gets token ids as its first forward argument.
    """
    spec = BatchSpec.coerce(batch)
    params = _forward_params(model)
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    kwargs: dict[str, Any] = {}
    if main == "pixel_values":
        size = spec.image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        fdtype = dtype or param_dtype(model)
        kwargs["pixel_values"] = torch.empty(spec.batch_size, channels, size, size, dtype=fdtype, device="meta")
    else:
        ids = torch.zeros(spec.batch_size, spec.seq_len, dtype=torch.long, device="meta")
        if main and main in params:
            kwargs[main] = ids
        elif "input_ids" in params:
            kwargs["input_ids"] = ids
        else:
            names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if not names:
                raise CaptureError(
                    f"{type(model).__name__}.forward takes no positional argument to put tokens in; "
                    "pass example inputs instead of a batch spec"
                )
            kwargs[names[0]] = ids
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            dec = spec.decoder_seq_len or spec.seq_len
            kwargs["decoder_input_ids"] = torch.zeros(spec.batch_size, dec, dtype=torch.long, device="meta")
        extra = image_inputs(model)   # a VL model's images for the tokens, as plan/forward.py gives them
        if extra is not None:
            images = extra(ids)
            # sizes the forward reads the values of (image grids) stay real: shapes on meta follow them
            sizes = {k: images.pop(k) for k in SIZE_INPUTS if k in images}
            images = {**to_meta_tree(images, dtype), **sizes}
            if "input_ids" in images and "input_ids" not in kwargs:
                kwargs[next(k for k, v in kwargs.items() if v is ids)] = images.pop("input_ids")
            kwargs.update(images)
    return (), with_defaults(model, kwargs)


def with_defaults(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Turn off KV caches: a training step has none and caches are objects export cannot return."""
    params = _forward_params(model)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    # a composite config (a VL model's) keeps use_cache in its text_config
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    has_cache = "use_cache" in params or (takes_any and (hasattr(config, "use_cache") or hasattr(text, "use_cache")))
    if has_cache and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    return kwargs


def to_meta_tree(obj: Any, dtype: torch.dtype | None = None) -> Any:
    """Same structure with every tensor replaced by an empty meta tensor of the same shape."""
    if isinstance(obj, torch.Tensor):
        dt = dtype if (dtype is not None and obj.is_floating_point()) else obj.dtype
        return torch.empty_strided(obj.shape, obj.stride(), dtype=dt, device="meta")
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_meta_tree(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: to_meta_tree(v, dtype) for k, v in obj.items()}
    return obj


def model_real_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that live on a real (non-meta) device."""
    total = 0
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def meta_model(
    model: nn.Module, dtype: torch.dtype | None = None, max_copy_bytes: int | None = DEFAULT_MAX_COPY_BYTES
) -> nn.Module:
    """The model itself when it is entirely on meta with every floating tensor already in
    ``dtype`` (or no dtype asked), else a meta copy. (A search captures and probes one model many
    times: it makes the copy once and hands it back here, which must then not copy again.)

    Raises ModelTooLargeError when real-device parameters exceed ``max_copy_bytes``.
    """
    real = model_real_bytes(model)
    if real == 0 and (dtype is None or all(t.dtype == dtype for t in list(model.parameters()) + list(model.buffers())
                                           if t.is_floating_point())):
        return model
    if max_copy_bytes is not None and real > max_copy_bytes:
        dev = next((t.device for t in model.parameters() if t.device.type != "meta"), None)
        raise ModelTooLargeError(
            f"{type(model).__name__} holds {real / 2**30:.2f} GiB of parameters/buffers on {dev}, "
            f"over max_copy_bytes={max_copy_bytes}; build it under torch.device('meta') "
            "(e.g. autoplan.presets.build_preset) or raise max_copy_bytes"
        )
    memo: dict[int, Any] = {}
    for t in set(model.parameters()) | set(model.buffers()):
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        fresh = torch.empty(t.shape, dtype=dt, device="meta")
        if isinstance(t, nn.Parameter):
            fresh = nn.Parameter(fresh, requires_grad=t.requires_grad)
        memo[id(t)] = fresh
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # a module holding an uncopyable object (lock, file handle)
        raise CaptureError(f"cannot copy {type(model).__name__} to meta for capture: {exc}") from exc


@contextlib.contextmanager
def meta_view(model: nn.Module, dtype: torch.dtype | None = None,
              max_copy_bytes: int | None = DEFAULT_MAX_COPY_BYTES) -> Iterator[nn.Module]:
    """``model`` on meta in ``dtype`` for the duration of the block, without copying it when it is
    already entirely on meta: its floating parameters and buffers are swapped for ``dtype`` meta
    tensors in place and swapped back on exit (a deep copy of a 126-layer model costs more than
    the capture that reads it). A model with real-device tensors gets a meta copy
    (:func:`meta_model`)."""
    if model_real_bytes(model) or dtype is None:
        yield meta_model(model, dtype, max_copy_bytes)
        return
    saved: list[tuple[Any, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for name, t in store.items():
                    if t is None or not t.is_floating_point() or t.dtype == dtype:
                        continue
                    if isinstance(t, nn.Parameter):
                        saved.append((t, "", t.data))
                        t.data = torch.empty(t.shape, dtype=dtype, device="meta")
                    else:
                        saved.append((store, name, t))
                        store[name] = torch.empty(t.shape, dtype=dtype, device="meta")
        yield model
    finally:
        for owner, name, t in reversed(saved):
            if name:
                owner[name] = t
            else:   # a tied parameter was swapped once (its second sight had the dtype already)
                owner.data = t


def resolve_inputs(model: nn.Module, inputs: Any, batch: Any, dtype: torch.dtype | None):
    """(args, kwargs) on meta from user inputs or a batch spec; MissingInputsError when neither."""
    if inputs is None and batch is None:
        raise MissingInputsError(
            f"capture({type(model).__name__}): give example `inputs` or a `batch` spec "
            "such as batch=(batch_size, seq_len)"
        )
    if inputs is None:
        return inputs_from_batch(model, batch, dtype)
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict) and isinstance(inputs[0], tuple):
        args, kwargs = inputs
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    return to_meta_tree(tuple(args), dtype), with_defaults(model, to_meta_tree(kwargs, dtype))
