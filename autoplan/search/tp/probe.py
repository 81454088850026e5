"""Strategies checked against the model itself before they enter the ILP.

A strategy is a guess about a module's code: that q/k/v feed the attention only through reshapes
by the *local* head count, that nothing inside normalises over a sharded width, that no
parameter other than the projections sees sharded activations. Names cannot tell; running can.
So every sharded candidate is applied to a copy of the model cut to one block per group, on meta,
and one training forward and backward runs under a fake process group of the planned degree
with fake tensors (no FLOPs, no memory). What happens decides:

- an exception (a Tensor mixed with a DTensor, a reshape by a global size, a width mismatch) --
  the candidate is rejected, and the reason is kept for the plan's ``explain``;
- a module that owns plain (non-DTensor) parameters and receives a tensor whose shape differs
  from the replicated run in exactly one dimension by the degree (Qwen3's q/k norms on
  head-sharded activations, OLMo-2's q norm on a column shard) would leave an un-reduced partial
  gradient: the candidate is *repaired* -- that module gets ``SequenceParallel`` on the sharded
  dimension (replicated DTensor parameters; DTensor reduces what must be reduced, also a norm
  over the sharded width) -- and probed again;
- any other shape change, or one outside every unit (on a sequence-sharded stream: a module
  the planner does not shard sees a sequence shard) -- the candidate, or the stream layout, is
  rejected.

The repair's collectives come from the same run: what the module issued in forward (recorded
per module), plus the all-reduce of each of its parameters' gradients in backward.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from autoplan.capture.blocks import only_representatives
from autoplan.capture.fake import valued_mode, values_on
from autoplan.capture.image_inputs import image_inputs
from autoplan.capture.inputs import meta_model
from autoplan.capture.quiet import quiet_torch
from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.search.tp.strategies import Strategy
from hyper_parallel.core.collective import Collective
from hyper_parallel import ParallelStyle, SequenceParallel, balanced_routing, loss_parallel, parallelize_module
from hyper_parallel.local import CollectiveRecorder

log = logging.getLogger(__name__)


@dataclass
class ProbeRun:
    """One forward/backward of a styled copy: the error, or every module's input shapes, the
    modules with plain parameters and the collectives each module issued in forward."""

    error: str | None = None
    inputs: dict[str, list[tuple]] = field(default_factory=dict)
    plain_param_modules: dict[str, list[int]] = field(default_factory=dict)   # fqn -> param bytes
    # every attention-core call (scaled_dot_product_attention, softmax) in order: (module, input shape)
    cores: list[tuple[str, tuple]] = field(default_factory=list)
    forward_collectives: dict[str, list[Collective]] = field(default_factory=dict)


@dataclass
class Finding:
    """A module the run says is unsound as styled: repairable on ``dim`` or not (``dim`` None)."""

    module: str          # FQN in the shortened copy
    dim: int | None
    detail: str


def _shape(x) -> tuple | None:
    if isinstance(x, DTensor):
        return ("dtensor",) + tuple(x.shape)
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    return None


def _routed_rows(hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    """A shape-true stand-in for an MoE experts container on fake tensors: the real forward sizes
    its work by the routing (data-dependent shapes fake tensors cannot run). The probe checks the
    dense units' styles; an experts style (ExpertParallel, DenseExpertsParallel) replaces this
    forward with its own, run on the balanced routing. Experts called on pre-scaled token copies
    alone (Llama-4: ``experts(hidden)``) return rows shaped like their input."""
    if top_k_weights is None:
        return hidden_states * 1
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def _stand_in_experts(model: nn.Module, groups, short) -> None:
    """Replace the forward of every experts container the capture recognised (roles ``moe``), and
    of every module it could only run at module level for reading data-dependent values (roles
    ``routed``: DBRX's experts, which no MoE entry names)."""
    for b in groups:
        roles = b.roles or {}
        paths = [e["experts"] for e in roles.get("moe", []) if e.get("experts")] + list(roles.get("routed", []))
        for path in paths:
            try:
                module = model.get_submodule(short(f"{b.representative}.{path}"))
            except AttributeError:
                continue
            module.forward = _routed_rows


class Prober:
    """Runs styled copies of ``model`` (cut to one block per group) at tensor-parallel degree
    ``tp`` on a fake process group. Build once per search; :meth:`run` per candidate set."""

    def __init__(self, model: nn.Module, groups, tp: int, batch: tuple[int, int], dtype: torch.dtype | None,
                 sibling: "Prober | None" = None):
        """``sibling``: a prober of the same model at another degree, whose shortened copy and
        replicated reference run this one shares (neither depends on the degree: the reference
        runs without styles, so it issues no collective)."""
        self.tp = tp
        self.batch = batch
        if sibling is not None:
            if sibling.batch != batch:
                raise ValueError(f"Prober: sibling batch {sibling.batch} differs from {batch}")
            self.small, self.short_of, self.reference = sibling.small, sibling.short_of, sibling.reference
            self.verdicts, self.report = None, None
            return
        # cut to one block per group first, then copy only that (a 126-layer copy per degree was
        # a second per search)
        with only_representatives(model, groups) as rename:
            small = meta_model(model, dtype)
            self.small = copy.deepcopy(small) if small is model else small
        self.short_of = {real: short for short, real in rename.items()}
        _stand_in_experts(self.small, groups, self.short)
        self.reference: ProbeRun | None = None
        self.verdicts: dict | None = None     # (unit, strategy, stream) -> checked Strategy, None if rejected
        self.report = None

    def short(self, fqn: str) -> str:
        for real, short in self.short_of.items():
            if fqn == real or fqn.startswith(real + "."):
                return short + fqn[len(real):]
        return fqn

    @staticmethod
    def _backward(logits, tokens) -> None:
        if _is_dtensor(logits):
            with loss_parallel():
                lm_loss(logits, tokens).backward()
        else:
            lm_loss(logits.float(), tokens).backward()

    def run(self, styles: dict[str, ParallelStyle], mesh, *, record: bool = False, backward: bool = False) -> ProbeRun:
        """Forward (and ``backward``) of a copy styled with ``styles``; ``record`` attributes the
        forward collectives to the innermost module issuing them. A run with nothing to record
        runs on meta tensors (DTensor's sharding rules and the collectives' meta kernels give the
        same shapes, several times cheaper than fake tensors), and on fake tensors only if meta
        cannot run it (a forward that makes CPU tensors); recording needs the fake process group
        to see the collectives, so it runs on fake tensors."""
        with quiet_torch():   # a style that fails is a verdict here, not torch's error output
            if not record:
                out = self._run(styles, mesh, record, backward, on_meta=True)
                if not out.error:
                    return out
                log.debug("probe run on meta failed (%s); running on fake tensors", out.error)
            out = self._run(styles, mesh, record, backward, on_meta=False)
            if out.error and "DataDependent" in out.error and image_inputs(self.small) is not None:
                # a size the tokens' values decide (a VL decoder indexing by its image tokens' mask)
                log.debug("probe run on fake tensors failed (%s); running with the tokens' values", out.error)
                out = self._run(styles, mesh, record, backward, on_meta=False, values=True)
            return out

    def _run(self, styles: dict[str, ParallelStyle], mesh, record: bool, backward: bool, on_meta: bool,
             values: bool = False) -> ProbeRun:
        model = copy.deepcopy(self.small)
        out = ProbeRun()
        stack: list[str] = []
        hooks = []

        def pre(name):
            def hook(mod, args, kwargs):
                stack.append(name)
                out.inputs[name] = [_shape(a) for a in list(args) + list(kwargs.values()) if _shape(a) is not None]
            return hook

        def post(name):
            def hook(mod, args, output):
                if stack and stack[-1] == name:
                    stack.pop()
            return hook

        cores = _CoreRecorder(stack, out.cores)
        try:
            if styles:
                parallelize_module(model, mesh, styles, strict=True)
            for name, mod in model.named_modules():
                hooks.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
                hooks.append(mod.register_forward_hook(post(name)))
                own = [p for p in mod.parameters(recurse=False)]
                if own and not any(_is_dtensor(p) for p in own):
                    out.plain_param_modules[name] = [p.numel() * p.element_size() for p in own]
            # fake tensors with a shape environment: a check on data (a VL model's "as many image
            # tokens as image features") becomes a deferred assertion instead of a failed run
            # (``values``: the tokens and what is made from them hold values, the weights none; capture.fake)
            tensors = contextlib.nullcontext() if on_meta else valued_mode() if values else \
                FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
            # experts split by ExpertParallel route fake tokens by the balanced assignment
            with tensors, cores, balanced_routing(), contextlib.ExitStack() as after_weights:
                if not on_meta:
                    model.to_empty(device="cpu")
                if values:
                    after_weights.enter_context(values_on(tensors))
                tokens = torch.zeros(self.batch, dtype=torch.long, device="meta" if on_meta else None)
                extra = {}
                if values:   # real tokens, and the image inputs made from them outside the fake mode
                    with unset_fake_temporarily():
                        tokens = torch.zeros(self.batch, dtype=torch.long, device="cpu")
                        extra = image_inputs(model)(tokens)
                if not record:
                    logits = output_logits(forward_tokens(model, tokens, **extra))
                    if backward:
                        self._backward(logits, tokens)
                    return out
                with CollectiveRecorder() as rec:
                    rec.phase = "forward"
                    seen = 0

                    def attribute():
                        nonlocal seen
                        for e in rec.events[seen:]:
                            c = Collective(e["kind"], "forward", int(e["bytes"]))
                            out.forward_collectives.setdefault(stack[-1] if stack else "", []).append(c)
                        seen = len(rec.events)

                    for name, mod in model.named_modules():  # attribute forward collectives on exit
                        hooks.append(mod.register_forward_hook(lambda *_: attribute()))
                    logits = output_logits(forward_tokens(model, tokens, **extra))
                    attribute()
                    rec.phase = "backward"
                    if backward:
                        self._backward(logits, tokens)
        except Exception as exc:  # noqa: BLE001 - the reason a candidate is rejected
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            out.error = last[:400]
            log.debug("probe run failed:\n%s", traceback.format_exc())
        finally:
            for h in hooks:
                h.remove()
        return out

    def lone_collectives(self, name: str, dim: int, mesh) -> list[Collective] | None:
        """What a repair issues, read off the runtime: the module ``name`` alone with
        ``SequenceParallel`` on ``dim``, given the shards the styled run gave it, forward and
        backward on fake tensors under the fake process group. The whole-model run cannot tell a
        module's backward collectives from its neighbours'; alone it can (OLMo-2's q norm: an
        all-reduce of the per-token sums in forward, in backward the weight gradient's
        all-gather and a reduce-scatter of the whole input gradient). None if it does not run
        alone (the caller keeps the forward record and the weight all-reduce)."""
        want = self.reference.inputs.get(name) if self.reference else None
        if not want:
            return None
        module = copy.deepcopy(self.small.get_submodule(name))
        params = list(module.parameters())
        dtype = params[0].dtype if params else torch.float32
        shapes = [tuple(-(-n // self.tp) if i == dim else n for i, n in enumerate(w)) for w in want]
        try:
            parallelize_module(module, mesh, {"": SequenceParallel(sequence_dim=dim, use_local_output=True,
                                                                   reduce_grads=True)}, strict=True)
            with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
                module.to_empty(device="cpu")
                xs = [torch.empty(s, dtype=dtype, requires_grad=True) for s in shapes]
                with CollectiveRecorder() as rec:
                    rec.phase = "forward"
                    out = module(*xs)
                    out = out[0] if isinstance(out, (tuple, list)) else out
                    rec.phase = "backward"
                    out.backward(torch.ones_like(out))
        except Exception as exc:  # noqa: BLE001 - reported by the caller's fallback
            log.debug("%s alone did not run: %s", name, exc)
            return None
        sizes = {p.numel() * p.element_size() for p in params}
        return [Collective(e["kind"], e["phase"], int(e["bytes"]),
                           weight_grad=e["phase"] == "backward" and int(e["bytes"]) in sizes) for e in rec.events]

    def findings(self, run: ProbeRun) -> list[Finding]:
        """Modules with plain parameters whose inputs changed shape from the replicated run, and
        attention cores that see anything but fewer heads (a reshape by the global head count
        can fold heads into the sequence and still run: OPT's ``view(b, -1, heads, hd)``)."""
        ref = self.reference
        found = self._core_findings(run) + self._global_shape_findings(run)
        for name in run.plain_param_modules:
            got, want = run.inputs.get(name), ref.inputs.get(name) if ref else None
            if got is None or want is None or got == want:
                continue
            dims = _sharded_dims(got, want, self.tp)
            if dims is None:
                found.append(Finding(name, None, f"{name} receives inputs {got} instead of {want}"))
            else:
                found.append(Finding(name, dims, f"{name} receives a shard on dim {dims} of {want}"))
        return found


    def _global_shape_findings(self, run: ProbeRun) -> list[Finding]:
        """Modules that receive a DTensor whose *global* shape differs from what the replicated run
        gave them: a local tensor annotated as a shard it is not (SequenceParallel on a norm that
        sees the whole sequence: Bloom's embedding norm before the first block would count the
        sequence tp times and over-reduce its weight gradients). Sound styles keep every DTensor's
        global shape equal to the replicated tensor's."""
        ref = self.reference.inputs if self.reference else {}
        out = []
        for name, got in run.inputs.items():
            want = ref.get(name)
            if want is None or len(got) != len(want):
                continue
            for g, w in zip(got, want):
                if g[:1] == ("dtensor",) and w[:1] != ("dtensor",) and tuple(g[1:]) != tuple(w):
                    out.append(Finding(name, None, f"{name} receives a DTensor of global shape {tuple(g[1:])} "
                                                   f"where the replicated model has {tuple(w)}"))
                    break
        return out

    def _core_findings(self, run: ProbeRun) -> list[Finding]:
        ref = self.reference.cores if self.reference else run.cores
        if run.error:  # a run cut short made fewer calls; its error decides
            ref = ref[:len(run.cores)]
        if len(run.cores) != len(ref):
            where = run.cores[len(ref)][0] if len(run.cores) > len(ref) else ref[len(run.cores)][0]
            return [Finding(where, None, f"{len(run.cores)} attention-core calls instead of {len(ref)}")]
        out = []
        for (mod, got), (_, want) in zip(run.cores, ref):
            if got == want:
                continue
            heads = len(want) - 3 if len(want) == 4 else 0   # (b, heads, s, d) or (b * heads, s, d)
            diff = [i for i, (a, b) in enumerate(zip(got, want)) if a != b] if len(got) == len(want) else None
            # a rank's share of whole heads: ceil(H / tp) for an even or chunked split, floor(H / tp)
            # on the lighter ranks of a head-aligned uneven one (uneven_heads.head_bounds)
            if diff != [heads] or not want[heads] // self.tp <= got[heads] <= -(-want[heads] // self.tp):
                out.append(Finding(mod, None, f"the attention core in {mod} sees {got} instead of {want} "
                                              f"(only the head dimension may shrink)"))
        return out


class _CoreRecorder(TorchFunctionMode):
    """Records the input shape of every attention-core call with the innermost module."""

    _FUNCS = frozenset({F.scaled_dot_product_attention, torch.softmax, F.softmax, torch.Tensor.softmax})

    def __init__(self, stack: list[str], calls: list):
        super().__init__()
        self.stack, self.calls = stack, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._FUNCS and args:
            shape = _shape(args[0])
            if shape is not None:
                self.calls.append((self.stack[-1] if self.stack else "", shape))
        return func(*args, **(kwargs or {}))


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def _sharded_dims(got: list[tuple], want: list[tuple], t: int) -> int | None:
    """The one dimension every changed input is divided on by ``t`` (None if not that simple)."""
    if len(got) != len(want):
        return None
    dims = set()
    for g, w in zip(got, want):
        if g == w:
            continue
        if len(g) != len(w) or g[:1] == ("dtensor",):
            return None
        diff = [i for i, (a, b) in enumerate(zip(g, w)) if a != b]
        if len(diff) != 1 or -(-w[diff[0]] // t) != g[diff[0]]:
            return None
        dims.add(diff[0])
    return dims.pop() if len(dims) == 1 else None


def repaired(strategy: Strategy, repairs: dict[str, int], param_bytes: dict[str, list[int]],
             forward: dict[str, list[Collective]], rel_of, lone: dict[str, list[Collective]] | None = None) -> Strategy:
    """``strategy`` plus SequenceParallel on each repaired module (relative to the unit's owner)
    and the collectives that repair issues: those it issued run alone (``lone``), else its
    recorded forward ones and one all-reduce per weight gradient."""
    lone = lone or {}
    styles = dict(strategy.styles)
    colls = list(strategy.collectives)
    names = []
    for module, dim in sorted(repairs.items()):
        rel = rel_of(module)
        styles[rel] = SequenceParallel(sequence_dim=dim, use_local_output=True, reduce_grads=True)
        if module in lone:   # what the module issued alone, forward and backward
            colls += lone[module]
        else:
            colls += forward.get(module, [])
            # a weight's gradient reduction: a split backward's input pass never reaches it
            colls += [Collective("all_reduce", "backward", b, weight_grad=True) for b in param_bytes.get(module, [])]
        names.append(rel.rsplit(".", 1)[-1])
    reason = strategy.reason + f"; {', '.join(names)} see sharded activations: replicated weights, gradients " \
                               f"all-reduced over tp"
    return dataclasses.replace(strategy, styles=styles, collectives=colls, reason=reason,
                               extra=dict(strategy.extra, repaired=sorted(names), unrepaired=strategy))
