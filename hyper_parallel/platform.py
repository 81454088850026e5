"""Device-type and backend selection, so no library code hard-codes "cuda".

Nothing here runs at import; callers ask when they need to know.
"""
from __future__ import annotations

import torch

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo", "xpu": "xccl"}


def has_npu() -> bool:
    """True when torch_npu is installed and an Ascend NPU is visible."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def device_type() -> str:
    """The accelerator this process should use: cuda, npu, or cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if has_npu():
        return "npu"
    return "cpu"


def backend_for(device: str | None = None) -> str:
    """The torch.distributed backend that matches a device type (nccl, hccl, gloo)."""
    device = device or device_type()
    return _BACKENDS.get(device, "gloo")


def device_module(device: str | None = None):
    """torch.cuda / torch.npu / None for cpu: the per-device runtime module."""
    device = device or device_type()
    return getattr(torch, device, None) if device != "cpu" else None


def current_device(device: str | None = None) -> torch.device:
    """This process's device of type ``device``: the cpu, or the accelerator's current index."""
    module = device_module(device)
    return torch.device(device or device_type(), module.current_device()) if module is not None else torch.device("cpu")
