"""Record the collectives a block of code issues: kind, logical bytes, group, phase.

Why it lives in the runtime: the planner's probe and verify's dry runs compare what a plan
predicts with what hyper_parallel actually issues, so the recorder is library code, not a test
helper. It sees functional collectives (through a dispatch mode, after DTensor desugars), c10d ops
and the Python API calls FSDP2 makes, on real or fake process groups, and names each kind in the
vocabulary plans use (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv).
"""
from __future__ import annotations

_KIND_WORDS = (("all_to_all", "all_to_all"), ("alltoall", "all_to_all"), ("reduce_scatter", "reduce_scatter"),
               ("all_gather", "all_gather"), ("allgather", "all_gather"), ("all_reduce", "all_reduce"),
               ("allreduce", "all_reduce"), ("broadcast", "broadcast"), ("send", "send_recv"),
               ("recv", "send_recv"))
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier")


def kind_of(op) -> str:
    """The plan vocabulary's kind of a collective op or op name (``all_gather_into_tensor`` ->
    ``all_gather``); a name that is no known collective comes back unchanged."""
    name = str(getattr(op, "__name__", op))
    for word, kind in _KIND_WORDS:
        if word in name:
            return kind
    return name


class CollectiveRecorder:
    """Records every functional collective a block of code issues: kind, logical bytes, group
    size, and whether it ran in backward. Logical bytes follow cost_models' convention: the
    full (gathered / pre-scatter / reduced) tensor. Works on the fake process group too.

        with CollectiveRecorder() as rec:
            loss = model(x).sum(); loss.backward()
        rec.frame()  # pandas DataFrame
    """

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._mode = None
        # None: phase from autograd (inside a backward node or not); set it to "forward" /
        # "backward" around the two halves of a step to also attribute end-of-backward callbacks
        self.phase: str | None = None
        self._in_api = False  # inside a patched torch.distributed call (already recorded)

    def __enter__(self) -> "CollectiveRecorder":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t is not torch.Tensor and issubclass(t, torch.Tensor) and t.__name__ == "DTensor"
                       for t in types):
                    # let DTensor desugar first (as CommDebugMode does): the collectives it
                    # issues then come back through this mode as plain-tensor ops
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                name = str(func)
                if ("_c10d_functional" in name or name.startswith("c10d.")) and not recorder._in_api and not any(
                        w in name for w in _NOT_COLLECTIVES):
                    kind = kind_of(name)
                    first = args[0]
                    t = first[0] if isinstance(first, (list, tuple)) else first
                    size = t.numel() * t.element_size()
                    group = _group_size(args, kind)
                    if kind == "all_gather":
                        size *= group
                    recorder.events.append({
                        "kind": kind, "bytes": int(size), "group_size": group, "group": _group_name(args),
                        "phase": recorder._phase(),
                    })
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        self._patch_python_api()
        return self

    def _phase(self) -> str:
        import torch

        if self.phase is not None:
            return self.phase
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def _patch_python_api(self) -> None:
        """FSDP2 calls torch.distributed's Python API (all_gather_single, reduce_scatter_single),
        which reaches the process group without passing the dispatcher; record those calls too."""
        import torch
        import torch.distributed as dist

        recorder = self
        self._saved = {}

        def wrap(name, kind, tensor_param):
            import inspect

            original = getattr(dist, name)
            sig = inspect.signature(original)

            def recorded(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                t = bound.arguments.get(tensor_param)
                pg = bound.arguments.get("group") or dist.group.WORLD
                if isinstance(t, torch.Tensor):
                    recorder.events.append({
                        "kind": kind, "bytes": int(t.numel() * t.element_size()), "group_size": pg.size(),
                        "group": dist.distributed_c10d._get_process_group_name(pg),
                        "phase": recorder._phase(),
                    })
                recorder._in_api = True
                try:
                    return original(*args, **kwargs)
                finally:
                    recorder._in_api = False

            self._saved[name] = original
            setattr(dist, name, recorded)

        # logical bytes: the gathered output / the pre-scatter input
        wrap("all_gather_single", "all_gather", "output_tensor")
        wrap("reduce_scatter_single", "reduce_scatter", "input")
        wrap("all_reduce", "all_reduce", "tensor")

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._mode.__exit__(*exc)

    def frame(self):
        import pandas as pd

        cols = ["kind", "phase", "group_size", "bytes"]
        df = pd.DataFrame(self.events, columns=cols)
        if df.empty:
            return pd.DataFrame(columns=cols + ["count"])
        return df.groupby(cols).size().reset_index(name="count").sort_values(cols).reset_index(drop=True)


def _unboxed(a):
    """c10d's point-to-point ops (send, recv_) receive their ProcessGroup boxed as a ScriptObject,
    which has neither ``size()`` nor ``group_name``; unbox it so P2P is attributed to its group."""
    import torch

    if isinstance(a, torch.ScriptObject):
        import torch.distributed as dist

        try:
            return dist.ProcessGroup.unbox(a)
        except Exception:  # noqa: BLE001 - some other script object: leave it
            return a
    return a


def _group_name(args) -> str | None:
    """The process group a collective ran on, by name: functional collectives pass it as their
    last string argument (after the reduce op), c10d ops pass a ProcessGroup object."""
    for a in reversed(args[1:]):
        a = _unboxed(a)
        if isinstance(a, str):
            return a
        name = getattr(a, "group_name", None)
        if isinstance(name, str):
            return name
    return None


def _group_size(args, kind: str) -> int:
    """The group size of a collective call: a process-group argument, or the int functional
    collectives take, or a group name resolved through torch.distributed."""
    for a in args[1:]:
        a = _unboxed(a)
        size = getattr(a, "size", None)
        if callable(size) and not hasattr(a, "shape"):
            try:
                return int(size())
            except Exception:  # noqa: BLE001 - not a process group after all
                pass
    ints = [a for a in args[1:] if isinstance(a, int) and not isinstance(a, bool)]
    if kind in ("all_gather", "reduce_scatter") and ints:
        return ints[0]
    import torch.distributed as dist

    for a in args[1:]:
        if isinstance(a, str):
            try:
                return dist.get_world_size(dist.distributed_c10d._resolve_process_group(a))
            except Exception:  # noqa: BLE001 - fall back below
                pass
    return ints[0] if ints else 1
