"""Values besides the hidden state that cross a stage boundary: what a decoder's forward makes from
the tower's output on stage 0 and hands its block loop (Qwen3-VL's DeepStack levels and their mask).

Why: a stage runs the model's own forward (forward_split.py), and a stage without the tower has no
image features, so the decoder gets ``None`` where stage 0's decoder got tensors. Qwen3-VL's text
model adds ``deepstack_visual_embeds[i]`` at ``visual_pos_masks`` after its layer ``i``: a layer
``i`` on stage 1 would skip the add and train another function (the guard measured a gap of 6.6).
The values are the model's own -- the keywords its decoder container (the block list's parent)
received -- so they are carried as they are, not re-derived: stage 0 records them at that call and
sends them behind its hidden state; a later stage gives them to its own call of the container
(where its forward passed ``None``) and sends them on while blocks remain after it. Floating-point
values arrive as leaves like the hidden state, so their gradients go back stage by stage to the
tower (stage 0's, or MPipe's owner).

Which keywords: those of the container's call that the token-only trace saw as ``None`` (the forward
makes them only when there are images) and that the model's top-level forward does not take (a
step's own keyword, such as an attention mask, reaches every stage anyway). On the wire: a ``uint8``
layout header of fixed size (keyword names, a list's length, a bool's dtype), then one tensor per
value; a bool mask crosses as ``uint8`` (a byte buffer every backend sends) and is turned back.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from hyper_parallel.errors import PipelineError

CARRIED_HEADER_BYTES = 256   # the layout of a few keywords (names and list lengths) as JSON


def encode_header(layout: dict, size: int, device, where: str) -> torch.Tensor:
    """``layout`` as JSON in ``size`` bytes (space-padded) of ``uint8``: a receiver rebuilds the
    structure of what follows without having run the sender's code."""
    data = json.dumps(layout, separators=(",", ":")).encode()
    if len(data) > size:
        raise PipelineError(f"{where}: the layout needs {len(data)} bytes, more than the {size} its header "
                            f"holds: {data[:120]!r}...")
    return torch.tensor(list(data.ljust(size)), dtype=torch.uint8, device=device)


def holds_values(header: torch.Tensor) -> bool:
    """False for a header on meta or fake tensors (a dry run): its bytes cannot be read."""
    return not (header.is_meta or is_fake(header))


def readable(header: torch.Tensor) -> bool:
    """Whether a carried header holds a layout: not on meta or fake tensors (a dry run), and not the
    zeros shape inference hands a receiver (a written header starts with JSON's ``{``)."""
    return holds_values(header) and int(header.reshape(-1)[0]) != 0


def decode_header(header: torch.Tensor) -> dict:
    """The layout :func:`encode_header` wrote."""
    local = header.to_local() if hasattr(header, "to_local") else header
    return json.loads(bytes(local.to("cpu").tolist()).decode())


def open_keywords(container_kwargs: dict, top_level: Sequence[str]) -> list[str]:
    """The keywords of a container call (on token ids alone) the forward left ``None`` and the
    model's top-level forward does not take: what only a stage with the tower's output can make."""
    return [k for k, v in container_kwargs.items() if v is None and k not in set(top_level)]


def pack(values: dict[str, Any]) -> list[torch.Tensor]:
    """The header and the tensors of ``values`` ({keyword: tensor or list of tensors}) as they cross;
    [] when there is nothing to carry (every family without DeepStack: one value crosses, as before)."""
    layout, tensors = {}, []
    for key, value in values.items():
        items = [value] if isinstance(value, torch.Tensor) else list(value)
        if not all(isinstance(v, torch.Tensor) for v in items):
            raise PipelineError(f"carried keyword {key!r}: a stage boundary carries tensors or lists of tensors, "
                                f"got {type(value).__name__}")
        kinds = ["bool" if v.dtype == torch.bool else "" for v in items]
        layout[key] = [-1 if isinstance(value, torch.Tensor) else len(items), kinds]
        for v, kind in zip(items, kinds):
            # a received leaf sent on as itself would be both a root and an input of the backward
            tensors.append(v.to(torch.uint8) if kind else (v.view_as(v) if v.requires_grad else v))
    if not tensors:
        return []
    first = tensors[0].to_local() if hasattr(tensors[0], "to_local") else tensors[0]
    return [encode_header(layout, CARRIED_HEADER_BYTES, first.device, "carried stage values"), *tensors]


def unpack(tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """{keyword: value} from what :func:`pack` sent."""
    if not tensors:
        return {}
    layout = decode_header(tensors[0])
    out, i = {}, 1
    for key, (n, kinds) in layout.items():
        items = [t.to(torch.bool) if kind == "bool" else t for t, kind in zip(tensors[i:i + len(kinds)], kinds)]
        i += len(kinds)
        out[key] = items[0] if n < 0 else items
    if i != len(tensors):
        raise PipelineError(f"carried stage values: the header lays out {i - 1} tensors, {len(tensors) - 1} arrived")
    return out
