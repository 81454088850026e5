"""The stage split of a model read from its own forward: each stage runs the model's code between its cuts.

Hand-written stage bodies ("spines") compute another function as soon as a model's forward does a
little more than call its units in order -- an embedding scaled in the forward, soft-capped
logits, a mask per layer kind, position ids, ALiBi biases. So a stage here does not re-implement
the forward; it *runs* it:

- **Trace** (once per model, :func:`trace_forward`): the model's forward is run on a tiny input
  (on fake tensors: no memory, no compute) with hooks on every module. The modules it calls from the
  *containers* (the root and the ancestors of the block list) are the units: a module with
  parameters is a unit (the blocks, the embeddings before them, the norms and head after them), one
  without is shared by every stage (RoPE tables, dropout). The trace records, per unit, where its
  hidden state comes in (argument position or keyword) and the shape of what it returns.
- **Stage forward** (:class:`ForwardStage`): the model's own top-level forward, with the units of
  other stages swapped out at their call sites (the parent's ``_modules`` entry, for the duration of
  the call): a unit *before* the stage returns zeros shaped as its traced output for the step's
  batch and full sequence (a stand-in: no compute, no hooks, no collectives -- the forward's code
  between them reads only shapes, dtypes and devices); the stage's first unit gets the received
  activation as its hidden state; the first unit of the *next* stage ends the forward, and the
  hidden state it was about to get is the stage's output. Everything else -- masks, positions,
  scaling, soft-capping, tied heads -- is the model's code, run where it runs without a pipeline.
  What the decoder's container gets that only stage 0 can make (Qwen3-VL's DeepStack levels and
  their mask, made from the tower's output) travels behind the hidden state (carried.py).
- The stage's own units are the real modules, registered on the stage under their original FQNs,
  so tensor-parallel styles, FSDP, recomputation and checkpoints address them as on the whole model.

A non-first stage feeds the forward a stand-in token tensor of the right shape (the sequence
length from the step's ``sequence_length`` when the activation is a sequence shard); the stand-in
units before the stage only forward shapes. :func:`~hyper_parallel.core.pipeline_parallel.split.split_gap`
compares the chained stages with the model's forward on a small copy: a forward whose data flow
the stand-ins and the carried keywords cannot carry shows as a gap and is refused.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from hyper_parallel.core.pipeline_parallel import carried as carried_values
from hyper_parallel.core.short_stack import short_stacks
from hyper_parallel.local.own_routing import OwnRouting
from hyper_parallel.errors import StageSplitError

# keywords the pipeline runner adds, not the model's: the full sequence length (a stage receiving a
# sequence shard), the micro-batch's token ids (every stage: a forward may read them beyond the
# embedding -- Qwen-VL's M-RoPE positions come from the image tokens' places), and the image
# features MPipe computed for stage 0 (image_features.INTO)
STAGE_TOKENS = "stage_tokens"
IMAGE_FEATURES = "image_features"
_RUNNER_KWARGS = ("sequence_length", STAGE_TOKENS, IMAGE_FEATURES)
# the step's image tensors (transformers' ``pixel_values``, ``pixel_values_videos``,
# ``pixel_attention_mask``): only the stage that runs the tower reads them
TOWER_INPUT_PREFIX = "pixel_"


@dataclass
class UnitCall:
    """One call the forward makes from a container: the unit's FQN, where its hidden state enters
    (a position or a keyword), and the tree of what it returned (leaves: (shape, dtype) of a tensor
    on the trace's (TRACE_BATCH, TRACE_SEQ) tokens, None for anything else)."""

    fqn: str
    slot: int | str | None
    out_spec: Any
    out_leaves: list[tuple[tuple[int, ...], torch.dtype] | None]

    def stand_in(self, batch: int, seq: int, like: torch.Tensor) -> Any:
        """What the unit returns, in shape, for ``batch`` sequences of ``seq`` tokens: zeros (a
        floating-point leaf in the activation's dtype) on the activation's device. The leading
        dimensions that were the trace's batch and sequence become the step's."""
        device = like.to_local().device if hasattr(like, "to_local") else like.device
        leaves = []
        for leaf in self.out_leaves:
            if leaf is None:
                leaves.append(None)
                continue
            shape, dtype = list(leaf[0]), leaf[1]
            if shape and shape[0] == TRACE_BATCH:
                shape[0] = batch
            if len(shape) > 1 and shape[1] == TRACE_SEQ:
                shape[1] = seq
            leaves.append(torch.zeros(shape, dtype=like.dtype if dtype.is_floating_point else dtype, device=device))
        return tree_unflatten(leaves, self.out_spec)


@dataclass
class ForwardTrace:
    """What the split knows about a model: its units in call order, which are blocks, which may
    start a stage, and the parameterless modules every stage keeps."""

    blocks_prefix: str
    calls: list[UnitCall]
    blocks: list[str]
    shared: list[str]
    lead: list[str] = field(default_factory=list)   # units before the first cut-able one: stage 0's
    # modules with parameters the token-only forward never calls, under the containers (a VL
    # model's vision tower and projector: they run when the step has images): stage 0's, or MPipe's
    side: list[str] = field(default_factory=list)
    side_params: list[str] = field(default_factory=list)   # the containers' own parameters beside a tower
    # the block list's parent and the keywords of its call only a stage with the tower's output can
    # fill (Qwen3-VL's DeepStack levels and mask): they cross stage boundaries (carried.py)
    decoder: str = ""
    carried: list[str] = field(default_factory=list)

    @property
    def units(self) -> list[str]:
        """Cut-able units in order (the planner's stage boundaries): the first unit, the blocks,
        and every unit after them whose hidden state is the stream's."""
        lead = set(self.lead)
        return [c.fqn for c in self.calls if c.fqn not in lead]


def _block_lists(model: nn.Module) -> list[str]:
    """FQNs of the outermost ModuleLists/Dicts holding modules with parameters (the block stacks)."""
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict)) or not name:
            continue
        if any(name.startswith(f + ".") for f in found):
            continue
        if any(any(True for _ in c.parameters()) for c in m.children()):
            found.append(name)
    return found


def attach(root: nn.Module, fqn: str, value: nn.Module | nn.Parameter) -> None:
    """Register a module or parameter of a model under ``root`` at its original FQN (plain
    ``nn.Module`` holders made on the way), so plans and checkpoints address it as on the model."""
    *path, leaf = fqn.split(".")
    parent = root
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    if isinstance(value, nn.Parameter):
        parent.register_parameter(leaf, value)
    else:
        parent.add_module(leaf, value)


def _called_lists(model: nn.Module, lists: list[str]) -> list[str]:
    """The block lists a token-only forward of ``model`` calls (on fake tensors): a VL model's
    vision encoder layers run only when the step has images, so its decoder is the one stack."""
    called: set[str] = set()
    handles = [child.register_forward_pre_hook(lambda m, a, name=name: called.add(name))
               for name in lists for child in model.get_submodule(name).children()]
    try:
        _fake_forward(model)
    except Exception:  # noqa: BLE001 - the trace proper reports a forward that cannot run
        return lists
    finally:
        for h in handles:
            h.remove()
        gc.collect()
    return [name for name in lists if name in called]


SHORTEN_FROM = 8   # block lists this long are traced through their first block (the guard's copies are short)


@contextlib.contextmanager
def _one_block(model: nn.Module, prefix: str):
    """A long stack of one block class traced through its first block alone (yields the function
    that expands the recorded calls back to every block). Why: the trace runs the whole forward on
    fake tensors, ~160 dispatches a block -- 1.9 s of a first 70B plan for what one block tells:
    where its hidden state enters and the shapes it returns, the same for every block of one class
    and config. What a short stack could hide -- a module the forward runs between its blocks --
    the pipeline guard's small copy (a short stack, traced in full, cut at every boundary) sees.
    The stack's config count follows the shortening while it lasts, and hooks transformers
    installs on the short stack are undone (short_stack.py)."""
    container = model.get_submodule(prefix)
    children = list(container.named_children())
    if not isinstance(container, nn.ModuleList) or len(children) < SHORTEN_FROM or \
            len({type(c) for _, c in children}) != 1:
        yield lambda calls: calls
        return
    first = f"{prefix}.{children[0][0]}"

    def expand(calls: list[UnitCall]) -> list[UnitCall]:
        out = []
        for c in calls:
            out += [UnitCall(f"{prefix}.{k}", c.slot, c.out_spec, c.out_leaves) for k, _ in children] \
                if c.fqn == first else [c]
        return out

    with short_stacks(model, {prefix: nn.ModuleList([children[0][1]])}):
        yield expand


def _fake_forward(model: nn.Module) -> None:
    # fake tensors: no memory, no compute, and transformers skips its data-dependent mask checks;
    # a model's own expert loop (DBRX's nonzero over its routing mask) runs on balanced routing values
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.no_grad(), mode, _Bf16GroupedMM(), OwnRouting():
        model(_tiny_input(model), **model_kwargs(model, {}))


def _side_modules(model: nn.Module, containers: dict[int, str], prefix: str, calls: list[UnitCall],
                  shared: list[str]) -> list[str]:
    """Children of the containers with parameters that the forward did not call: the tower a VL
    model runs only on images (see :attr:`ForwardTrace.side`)."""
    taken = {c.fqn for c in calls} | set(shared) | {prefix} | set(containers.values())
    out = []
    for path in containers.values():
        parent = model.get_submodule(path) if path else model
        for name, child in parent.named_children():
            fqn = f"{path}.{name}" if path else name
            if fqn not in taken and any(True for _ in child.parameters()):
                out.append(fqn)
    return out


def _containers(model: nn.Module, prefix: str) -> dict[int, str]:
    """id -> FQN of the root and every module on the path to the block list (the list excluded)."""
    parts = prefix.split(".")
    out = {id(model): ""}
    for k in range(1, len(parts)):
        path = ".".join(parts[:k])
        out[id(model.get_submodule(path))] = path
    return out


def _slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where the hidden state enters a call: the first floating-point tensor argument."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return i
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k
    return None


# the trace's tokens: a sequence context parallelism can split (2·cp divides it for cp <= 8)
TRACE_BATCH, TRACE_SEQ = 2, 16


def _tiny_input(model: nn.Module) -> torch.Tensor:
    p = next(model.parameters())
    device = p.to_local().device if hasattr(p, "to_local") else p.device
    return torch.zeros(TRACE_BATCH, TRACE_SEQ, dtype=torch.long, device=device)


def model_kwargs(model: nn.Module, kwargs: dict) -> dict:
    """The step's keywords the model's forward takes, with ``use_cache=False`` where it has one (a
    KV cache is inference state; it would also be another value crossing stages)."""
    out = {k: v for k, v in kwargs.items() if k not in _RUNNER_KWARGS}
    if "use_cache" in inspect.signature(model.forward).parameters:
        out.setdefault("use_cache", False)
    return out


_TRACES: dict[tuple, ForwardTrace] = {}


def _trace_key(model: nn.Module) -> tuple:
    """Copies of one architecture share a trace (the dry run's meta copies, a model after tensor
    parallelism): class, config and module names (styles, FSDP and recomputation keep the names)."""
    config = getattr(model, "config", None)
    cfg = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else None
    name = type(model).__name__
    return (name[4:] if name.startswith("FSDP") else name, cfg, tuple(n for n, _ in model.named_modules()))


def trace_forward(model: nn.Module) -> ForwardTrace:
    """The model's forward as units (cached per architecture). Call it before tensor parallelism
    is applied (the pipeline runner does): the trace runs one tiny forward of the model."""
    key = _trace_key(model)
    if key in _TRACES:
        return _TRACES[key]
    lists = _block_lists(model)
    if not lists:
        raise StageSplitError(f"split: {type(model).__name__} has no block list (an nn.ModuleList or ModuleDict "
                              "of modules with parameters) to cut between")
    if len(lists) > 1:
        lists = _called_lists(model, lists) or lists
    if len(lists) > 1:
        raise StageSplitError(
            f"split: {type(model).__name__} runs {len(lists)} block stacks ({', '.join(lists)}); an encoder-decoder "
            "pipeline would have to carry the first stack's output to every stage of the second (its cross "
            "attention reads it) and a stage carries one hidden state -- pipelining encoder-decoder models is "
            "not supported (plan them with pp=1)")
    prefix = lists[0]
    containers = _containers(model, prefix)
    block_ids = {id(m): f"{prefix}.{k}" for k, m in model.get_submodule(prefix).named_children()}
    names = {id(m): n for n, m in model.named_modules() if n}
    held = {}   # parameters of the containers themselves: the tower's (if there is one), else no stage's
    for cid, path in containers.items():
        for name in (model.get_submodule(path)._parameters if path else model._parameters):
            held[f"{path}.{name}" if path else name] = path
    stack: list[int] = []
    calls: list[UnitCall] = []
    shared: list[str] = []
    seen: set[str] = set()
    decoder = prefix.rpartition(".")[0]
    decoder_id = id(model.get_submodule(decoder)) if decoder else id(model)
    open_kwargs: list[str] = []
    top_level = list(inspect.signature(model.forward).parameters)

    def pre(module, args, kwargs):
        if id(module) == decoder_id and not open_kwargs:
            open_kwargs.extend(carried_values.open_keywords(kwargs, top_level))
        top = all(i in containers for i in stack)
        stack.append(id(module))
        if top and id(module) not in containers:
            module._hp_trace_args = (args, kwargs)

    def post(module, args, kwargs, out):
        if stack and stack[-1] == id(module):
            stack.pop()
        rec = module.__dict__.pop("_hp_trace_args", None)
        if rec is None:
            return
        fqn = block_ids.get(id(module)) or names.get(id(module))
        if not any(True for _ in module.parameters()):
            if fqn not in shared:
                shared.append(fqn)
            return
        if fqn in seen:
            raise StageSplitError(f"split: {type(model).__name__}'s forward calls {fqn} twice; a unit must run "
                                  "once, at one place of the forward")
        seen.add(fqn)
        leaves, spec = tree_flatten(out)
        calls.append(UnitCall(fqn, _slot(*rec), spec, [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                                                       else None for v in leaves]))

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
    try:
        with _one_block(model, prefix) as expand:
            _fake_forward(model)
    except StageSplitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run on a tiny input cannot be traced
        raise StageSplitError(f"split: {type(model).__name__}'s forward could not be traced on a ({TRACE_BATCH}, "
                              f"{TRACE_SEQ}) token input ({type(exc).__name__}: {str(exc)[:200]})") from exc
    finally:
        for h in handles:
            h.remove()
        for m in model.modules():
            m.__dict__.pop("_hp_trace_args", None)
        # the fake mode holds weak references to the parameters it converted, and torch refuses to
        # swap a tensor with one (materialising a meta model does): collect it now
        gc.collect()
    calls = expand(calls)
    blocks = [c.fqn for c in calls if c.fqn.startswith(prefix + ".")]
    if not blocks:
        raise StageSplitError(f"split: {type(model).__name__}'s forward never called a block of {prefix}")
    first = next(i for i, c in enumerate(calls) if c.fqn == blocks[0])
    last = max(i for i, c in enumerate(calls) if c.fqn in set(blocks))
    if [c.fqn for c in calls[first:last + 1]] != blocks:
        between = [c.fqn for c in calls[first:last + 1] if c.fqn not in set(blocks)]
        raise StageSplitError(f"split: {type(model).__name__}'s forward runs {between} between its blocks; "
                              "a stage boundary there has no single hidden state")
    for c in calls[last + 1:]:   # cut points: what reaches them is the stream
        if c.slot is None:
            raise StageSplitError(f"split: {type(model).__name__}'s forward calls {c.fqn} with no floating-point "
                                  "input; the split cannot tell what reaches it")
    lead = [c.fqn for c in calls[1:first]]   # position embeddings, embedding norms: with the embedding
    side = _side_modules(model, containers, prefix, calls, shared)
    if held and not side:
        path = next(iter(held.values()))
        raise StageSplitError(f"split: {type(model).__name__}.{path or '<root>'} holds parameters "
                              f"{[k for k, v in held.items() if v == path]} that its forward uses outside any "
                              "submodule; no stage would own them")
    # beside a tower, a container's own parameter is the tower's (LLaVA-NeXT's image_newline, which
    # its image features end with): the token-only forward called no module that could own it
    trace = ForwardTrace(prefix, calls, blocks, shared, lead, side, list(held), decoder, open_kwargs)
    _TRACES[key] = trace
    return trace


class _Bf16GroupedMM(TorchDispatchMode):
    """The fake kernel of ``torch._grouped_mm`` (MoE experts) accepts only bf16: the trace, which
    reads shapes, runs it in bf16 and hands back the caller's dtype."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is getattr(torch.ops.aten._grouped_mm, "default", None) and args[0].dtype != torch.bfloat16:
            dtype = args[0].dtype
            cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args]
            return func(*cast, **kwargs).to(dtype)
        return func(*args, **kwargs)


class _Proxy(nn.Module):
    """Stands at a unit's call site during one stage forward; attribute reads reach the real unit
    (a forward may read ``layer.attention_type``)."""

    def __init__(self, real: nn.Module, run):
        super().__init__()
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)

    def forward(self, *args, **kwargs):
        return self._run(self._real, args, kwargs)


class _StageOutput(BaseException):
    """Ends a stage's forward at the next stage's first unit (a BaseException: no ``except
    Exception`` in a model's forward swallows it)."""

    def __init__(self, value):
        super().__init__()
        self.value = value


def _with_slot(args: tuple, kwargs: dict, slot, value):
    if isinstance(slot, int):
        args = args[:slot] + (value,) + args[slot + 1:]
    else:
        kwargs = {**kwargs, slot: value}
    return args, kwargs


def _at_slot(args: tuple, kwargs: dict, slot):
    return args[slot] if isinstance(slot, int) else kwargs[slot]


class ForwardStage:
    """Runs stage ``units`` of ``model`` by running the model's forward (see the module docstring)."""

    def __init__(self, model: nn.Module, trace: ForwardTrace, units: Sequence[str], stage_index: int,
                 next_unit: str | None):
        self.model = model
        self.trace = trace
        self.index = {c.fqn: c for c in trace.calls}
        order = [c.fqn for c in trace.calls]
        self.start = units[0] if stage_index > 0 else None
        self.before = order[:order.index(units[0])] if stage_index > 0 else []
        self.next_unit = next_unit
        # the decoder's carried keywords go on only to a stage that starts at a block (one after
        # the last block runs none of the decoder's loop: its norm and head read no such value)
        self.carry_on = next_unit in set(trace.blocks)

    def _swap(self, fqn: str, run) -> tuple[nn.Module, str, nn.Module]:
        parent_name, _, leaf = fqn.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        real = parent._modules[leaf]
        parent._modules[leaf] = _Proxy(real, run)
        return parent, leaf, real

    def __call__(self, x: torch.Tensor, kwargs: dict, carried: Sequence[torch.Tensor] = ()) -> Any:
        swaps = []
        received = x
        found: dict[str, Any] = {}
        hook, unread = self._carry_hook(carried, found)
        try:
            if self.start is not None:
                batch, seq = received.shape[0], int(kwargs.get("sequence_length") or received.shape[1])
                for fqn in self.before:
                    swaps.append(self._swap(fqn, lambda r, a, k, c=self.index[fqn]: c.stand_in(batch, seq, received)))
                slot = self.index[self.start].slot

                def enter(real, args, kw):
                    args, kw = _with_slot(args, kw, slot, received)
                    return real(*args, **kw)

                swaps.append(self._swap(self.start, enter))
            if self.next_unit is not None:
                nslot = self.index[self.next_unit].slot

                def leave(real, args, kw):
                    raise _StageOutput(_at_slot(args, kw, nslot))

                swaps.append(self._swap(self.next_unit, leave))
            if self.start is None:
                inputs = x
            else:
                given = kwargs.get(STAGE_TOKENS)
                inputs = given if given is not None else self._stand_in_tokens(received, kwargs)
            out = self.model(inputs, **self._model_kwargs(kwargs))
        except _StageOutput as done:
            if not self.carry_on:
                return done.value
            sent = carried_values.pack(found) if unread is None else unread
            if not sent:
                return done.value
            return (done.value, *sent)
        finally:
            if hook is not None:
                hook.remove()
            for parent, leaf, real in reversed(swaps):
                parent._modules[leaf] = real
        if self.next_unit is not None:
            raise StageSplitError(f"split: the forward of {type(self.model).__name__} returned without calling "
                                  f"{self.next_unit}, the next stage's first unit")
        logits = getattr(out, "logits", None)
        if logits is not None:
            return logits
        return out[0] if isinstance(out, (tuple, list)) else out

    def _carry_hook(self, carried: Sequence[torch.Tensor], found: dict):
        """(a pre-hook on the decoder container for one stage forward, or None; the received values
        to send on unread, or None). The hook gives the container the values the previous stage
        carried (where this forward, without the tower's output, passed None) and records into
        ``found`` what the container got, to send on (carried.py)."""
        if not self.trace.carried:
            if carried:
                raise StageSplitError(f"split: {type(self.model).__name__}'s stage got {len(carried)} values besides "
                                      "its hidden state, but its decoder's call takes none from another stage")
            return None, None
        if carried and not carried_values.readable(carried[0]):
            # shape inference (zeros) or a dry run (fake tensors): only shapes matter, the values are
            # sent on as they came and not given to the decoder (a mask without values cannot index)
            return None, [t.view_as(t) if t.requires_grad else t for t in carried]
        given = carried_values.unpack(carried)

        def pre(module, args, kw):
            kw = {**kw, **{k: v for k, v in given.items() if kw.get(k) is None}}
            found.update({k: kw[k] for k in self.trace.carried if kw.get(k) is not None})
            return args, kw

        container = self.model.get_submodule(self.trace.decoder) if self.trace.decoder else self.model
        return container.register_forward_pre_hook(pre, with_kwargs=True), None

    def _model_kwargs(self, kwargs: dict) -> dict:
        """What this stage's forward gets of the step's keywords. Image tensors reach only the
        stage that runs the tower, stage 0 (later stages do not run it: its output only feeds the
        embedding, a stand-in there); under MPipe stage 0 gets the tower's output instead and
        hands it to the forward the way transformers takes precomputed encoder outputs."""
        out = model_kwargs(self.model, kwargs)
        features = kwargs.get(IMAGE_FEATURES)
        if self.start is not None or features is not None:
            out = {k: v for k, v in out.items() if not k.startswith(TOWER_INPUT_PREFIX)}
        if self.start is None and features is not None:
            out["mm_encoder_outputs"] = {"image": features}
        return out

    @staticmethod
    def _stand_in_tokens(h: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Token ids of the micro-batch's shape for the forward's code before this stage (only
        their shape is read: the units that would embed them are stand-ins)."""
        length = int(kwargs.get("sequence_length") or h.shape[1])
        local = h.to_local() if hasattr(h, "to_local") else h
        return torch.zeros(h.shape[0], length, dtype=torch.long, device=local.device)
