"""Captured graphs kept on disk (``autoplan.disk_cache``), keyed by a fingerprint of the model and
its inputs: a fresh process plans a model it (or an earlier process) captured without running
torch.export again (six exports per cp degree were seconds of a cold 405B plan at 128K).

What the key holds -- everything capture reads, or could read, beyond parameter values (capture
runs on meta, so values never matter):
- every module's path, class (module and qualified name) and plain attributes (numbers,
  strings, flags, dtypes, tuples of them; for other objects their type and for functions their
  qualified name), every parameter's and buffer's name, shape, dtype, device type and
  ``requires_grad``, and each distinct config object attached to a module (HF configs as their
  full JSON, other configs as their ``repr``);
- the bytes of the source file of every module class (a model edited in place gets a new key),
  and the version of the package that file belongs to where it is installed;
- the resolved inputs (shape, dtype, device type of each tensor; other leaves by value) and
  capture's own arguments;
- the version (``disk_cache.code_version``): the capture package's source, Python, torch and
  transformers.
A model whose class has no source file (defined in a notebook cell or ``python -c``) or an input
the key cannot describe is not cached: capture runs as without a cache.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from autoplan import disk_cache, errors
from autoplan.capture.ir import ModelGraph
from hyper_parallel.core.tensor_parallel import linear_styles

log = logging.getLogger(__name__)
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


class _Unkeyable(Exception):
    """The model or its inputs hold something the key cannot describe."""


def _version() -> str:
    here = Path(__file__).parent
    return disk_cache.code_version(*sorted(str(p) for p in here.glob("*.py")), errors.__file__, linear_styles.__file__)


@functools.lru_cache(maxsize=None)
def _source_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _value(v: Any, configs: dict) -> Any:
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (tuple, list, set, frozenset)) and len(v) <= 256 and all(isinstance(x, _PLAIN) for x in v):
        return sorted(repr(x) for x in v) if isinstance(v, (set, frozenset)) else [repr(x) for x in v]
    if isinstance(v, dict) and len(v) <= 256 and all(isinstance(x, _PLAIN) for kv in v.items() for x in kv):
        return sorted((repr(k), repr(x)) for k, x in v.items())
    if hasattr(v, "to_json_string") and hasattr(v, "to_dict"):   # a transformers config
        if id(v) not in configs:
            configs[id(v)] = v.to_json_string(use_diff=False)
        return f"config#{list(configs).index(id(v))}"
    if callable(v) and hasattr(v, "__qualname__"):
        return f"fn {getattr(v, '__module__', '')}.{v.__qualname__}"
    if type(v).__name__.endswith("Config") or hasattr(v, "__dataclass_fields__"):
        if id(v) not in configs:
            configs[id(v)] = repr(v)
        return f"config#{list(configs).index(id(v))}"
    return f"obj {type(v).__module__}.{type(v).__qualname__}"


def _class_source(cls: type, files: dict) -> None:
    if cls.__module__ in files:
        return
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if not path or not Path(path).is_file():
        raise _Unkeyable(f"{cls.__qualname__} has no source file")
    files[cls.__module__] = _source_digest(path)


def _model_fingerprint(model: nn.Module) -> dict:
    configs: dict[int, str] = {}
    files: dict[str, str] = {}
    modules = []
    for name, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        _class_source(cls, files)
        attrs = sorted((k, _value(v, configs)) for k, v in vars(mod).items()
                       if not k.startswith("_") or k == "_version")
        tensors = [(k, list(t.shape), str(t.dtype), t.device.type, bool(t.requires_grad))
                   for k, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None]
        modules.append([name, f"{cls.__module__}.{cls.__qualname__}", attrs, tensors])
    return {"modules": modules, "configs": list(configs.values()), "sources": sorted(files.items())}


def model_key(model: nn.Module) -> str | None:
    """The model part of the key (module tree, configs, class sources) as JSON, for other results
    that are a function of the model alone (``pipeline.support.pipeline_layout``); None when the
    cache is off or the model cannot be described."""
    if not disk_cache.enabled():
        return None
    try:
        return json.dumps(_model_fingerprint(model), sort_keys=True)
    except _Unkeyable as e:
        log.debug("disk cache: model not keyable: %s", e)
        return None


def _inputs_fingerprint(args: tuple, kwargs: dict) -> list:
    leaves, spec = tree_flatten((args, kwargs))
    out: list = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(["T", list(x.shape), str(x.dtype), x.device.type, bool(x.requires_grad)])
        elif isinstance(x, _PLAIN):
            out.append(repr(x))
        else:
            raise _Unkeyable(f"input of type {type(x).__name__}")
    return out


def graph_key(model: nn.Module, args: tuple, kwargs: dict, **options: Any) -> str | None:
    """The cache key of capturing ``model`` on these resolved inputs, or None (not cacheable)."""
    if not disk_cache.enabled():
        return None
    try:
        body = {"model": _model_fingerprint(model), "inputs": _inputs_fingerprint(args, kwargs),
                "options": {k: repr(v) for k, v in sorted(options.items())}}
    except _Unkeyable as e:
        log.debug("capture cache: not cached: %s", e)
        return None
    return json.dumps(body, sort_keys=True)


def load_graph(key: str | None) -> ModelGraph | None:
    if key is None:
        return None
    raw = disk_cache.load("graphs", _version(), key)
    if raw is None:
        return None
    try:
        graph = pickle.loads(raw)
    except Exception as e:   # a damaged or foreign entry: a miss (captured again and rewritten)
        log.debug("capture cache: unreadable entry: %s", e)
        return None
    return graph if isinstance(graph, ModelGraph) else None


def store_graph(key: str | None, graph: ModelGraph) -> None:
    if key is not None:
        disk_cache.store("graphs", _version(), key, pickle.dumps(graph, protocol=pickle.HIGHEST_PROTOCOL))
