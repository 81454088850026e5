"""Data parallelism of a plan: which mesh it runs on, and replicated DP's one all-reduce per step.

Three forms: FSDP over ``plan.dp_dim``; HSDP (a ``parallel.hsdp`` section): ``fully_shard``
on the 2-D mesh (dp_replicate, dp_shard) -- parameters sharded within a dp_shard group, every
shard group a replica, gradients reduce-scattered over dp_shard then all-reduced over
dp_replicate (torch FSDP2's HSDP); and replicated DP for plans that choose it over FSDP: each
rank keeps whole (TP-sharded) parameters; after backward the local gradients are flattened into
one buffer, summed over the dp group and divided by its size. One collective of a known size
per step keeps the plan's prediction exact and the cost low on any backend (gloo has no average
reduction, hence sum then divide).
"""
from __future__ import annotations

import inspect
import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanSchemaError
from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from hyper_parallel import fully_shard
from hyper_parallel.core.dtensor import fsdp_shard_placement, fsdp_unshardable
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.errors import MeshError


def dp_dims(plan) -> tuple[str, ...]:
    """The plan's data-parallel mesh dimensions, outermost first: (dp_replicate, dp_shard) for
    HSDP, (dp_dim,) otherwise, () without data parallelism."""
    hsdp = plan.parallel.get("hsdp")
    dims = ((hsdp["dim"],) if hsdp else ()) + ((plan.dp_dim,) if plan.dp_dim else ())
    return tuple(d for d in dims if d in tuple(plan.mesh["names"]))


def dp_degree(plan) -> int:
    """Data-parallel ranks of the plan (product of its dp dimensions): the batch is split this many ways."""
    sizes = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    return math.prod(int(sizes[d]) for d in dp_dims(plan))


def dp_mesh(plan, mesh):
    """The (sub-)mesh data parallelism runs on: 2-D (dp_replicate, dp_shard) for HSDP, 1-D for
    FSDP / replicated DP, None when the plan has no dp dimension on ``mesh``."""
    dims = dp_dims(plan)
    if not dims or any(d not in tuple(mesh.mesh_dim_names or ()) for d in dims):
        return None
    return mesh[dims] if len(dims) > 1 else mesh[dims[0]]


def grad_dims(plan) -> tuple[str, ...]:
    """The mesh dimensions gradients are averaged over (and FSDP shards over): the dp dimensions,
    and with context parallelism the cp dimension after them -- cp ranks hold the same parameters
    and see different tokens, so torchtitan folds cp into FSDP's group."""
    cp = plan.parallel.get("cp")
    return dp_dims(plan) + ((cp["dim"],) if cp else ())


def flat_name(dims: tuple[str, ...]) -> str:
    """The name of the flattened mesh of ``dims`` (torch's default for ``DeviceMesh._flatten``):
    "dp_cp"; a single dimension keeps its own name."""
    return "_".join(dims)


def grad_mesh(plan, mesh):
    """The mesh FSDP shards over and gradients are averaged over: ``dp_mesh`` without context
    parallelism; with it the 1-D flattened dp x cp mesh (or the cp mesh alone without dp)."""
    if not plan.parallel.get("cp"):
        return dp_mesh(plan, mesh)
    dims = grad_dims(plan)
    if any(d not in tuple(mesh.mesh_dim_names or ()) for d in dims):
        return None
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten(flat_name(dims))


def expert_containers(model: torch.nn.Module, plan) -> list[torch.nn.Module]:
    """The experts containers the plan's ExpertParallel styles name (``parallel.ep.styles``), once each."""
    out: list[torch.nn.Module] = []
    for pattern in (plan.parallel.get("ep") or {}).get("styles") or {}:
        out += [m for _, m in match_modules(model, pattern) if not any(m is o for o in out)]
    return out


def state_dims(plan) -> tuple[str, ...]:
    """The mesh dimensions FSDP (and ZeRO-1) shard the parameters outside the experts over: the
    gradient dimensions (``grad_dims``) and, with an ep dimension, ep too, in the mesh's order. The ep
    dimension shards the batch (ep borrows from dp), so its ranks hold the same non-expert
    parameters and see different tokens -- as cp does; FSDP2 over the flattened dp x ep mesh
    (torchtitan's ``dp_shard_mod_ep`` / NeMo AutoModel's ``dp_shard x ep``) averages their gradients
    over every batch shard in its reduce-scatter and holds 1/(dp x ep) of their state. The
    experts stay on ``grad_dims`` (their ep shards differ)."""
    dims = grad_dims(plan)
    ep = (plan.parallel.get("ep") or {}).get("dim")
    names = tuple(plan.mesh["names"])
    if not dims or ep is None or ep not in names or ep in dims or plan.parallel.get("hsdp"):
        return dims   # (HSDP keeps its 2-D mesh: ep replicates the non-expert state there)
    return tuple(sorted(dims + (ep,), key=names.index))


def state_mesh(plan, mesh):
    """The flattened (dp[, cp], ep) mesh FSDP shards the non-expert parameters over
    (:func:`state_dims`), or None where that is FSDP's own mesh: no ep dimension, one of size 1,
    or HSDP (which keeps its 2-D mesh; ep then replicates the non-expert state, as before)."""
    dims = state_dims(plan)
    names = tuple(mesh.mesh_dim_names or ())
    if dims == grad_dims(plan) or any(d not in names for d in dims):
        return None
    if math.prod(mesh[d].size() for d in dims) == math.prod(mesh[d].size() for d in grad_dims(plan)):
        return None
    return mesh[dims]._flatten(flat_name(dims))


def dp_group(dp_mesh):
    """The process group of every dp rank: the 1-D mesh's own, or the flattened 2-D HSDP mesh's
    (what averages a loss or a shared parameter's gradient over all data-parallel ranks)."""
    return dp_mesh.get_group() if dp_mesh.ndim == 1 else dp_mesh._flatten().get_group()


def dp_rank(dp_mesh) -> int:
    """This rank's index among the dp ranks (row-major over a 2-D HSDP mesh)."""
    rank = 0
    for size, c in zip(dp_mesh.shape, dp_mesh.get_coordinate()):
        rank = rank * size + c
    return rank


def dp_share(inputs: torch.Tensor, targets: torch.Tensor, dp_mesh, who: str):
    """Rows of a global batch that belong to this rank's data-parallel coordinate."""
    if dp_mesh is None or dp_mesh.size() == 1:
        return inputs, targets
    n, r = dp_mesh.size(), dp_rank(dp_mesh)
    if inputs.shape[0] % n:
        raise MeshError(f"{who}.local_batch: batch {inputs.shape[0]} not divisible by dp={n}")
    k = inputs.shape[0] // n
    return inputs[r * k:(r + 1) * k], targets[r * k:(r + 1) * k]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group, world: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``world`` ranks) in one all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if world <= 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def unique_params(*modules: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``modules`` once each, in registration order: a tied parameter
    counted once -- also across modules (a V schedule puts the first and the last pipeline stage on
    one rank, where a tied embedding and head are one Parameter in two stage modules)."""
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


def mixed_precision_policy(fsdp: dict | None):
    """FSDP2 ``MixedPrecisionPolicy`` of a plan's ``fsdp["mixed_precision"]`` (None: full precision).

    The planner prices 16-bit compute with fp32 master weights: parameters stay fp32 in the
    sharded state the optimizer updates, each unit all-gathers them cast to ``param_dtype`` and
    computes in it, and gradients are reduce-scattered in ``reduce_dtype`` (fp32, so the sum over
    dp ranks does not round). ``{"param_dtype": "bfloat16", "reduce_dtype": "float32"}``.
    """
    spec = (fsdp or {}).get("mixed_precision")
    if not spec:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dt(key: str, default: str) -> torch.dtype:
        name = str(spec.get(key, default)).replace("torch.", "")
        d = getattr(torch, name, None)
        if not isinstance(d, torch.dtype):
            raise PlanSchemaError(f"plan.fsdp.mixed_precision.{key}={spec.get(key)!r} is not a torch dtype "
                            f"(e.g. 'bfloat16', 'float32')")
        return d

    return MixedPrecisionPolicy(param_dtype=dt("param_dtype", "bfloat16"), reduce_dtype=dt("reduce_dtype", "float32"))


def fsdp_kwargs(fsdp: dict | None) -> dict:
    """Keyword arguments for every ``fully_shard`` call of a plan: its mixed-precision policy, and
    the shard dimension of packed tensor-parallel weights (``fsdp_shard_placement``; the planner's
    FSDP byte counts, ``search.sharding.ParamShard.fsdp_dim``, follow the same rule)."""
    mp = mixed_precision_policy(fsdp)
    kw = {"shard_placement_fn": fsdp_shard_placement}
    return dict(kw, mp_policy=mp) if mp is not None else kw


def prefetch_blocks(blocks: list, depth: int) -> None:
    """FSDP2 explicit prefetch: each block's forward issues the all-gathers of the next ``depth``
    blocks and its backward those of the ``depth`` blocks before it, so a gather runs while
    earlier compute does (``depth`` 0: FSDP2's implicit order, one block ahead as each runs)."""
    if depth <= 0:
        return
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


def plan_dp_mode(plan) -> str:
    """The plan's data-parallel mode: ``fsdp`` | ``zero1`` | ``replicate`` (``fsdp.mode``; plans
    written before it existed say only ``fsdp.enabled``)."""
    fsdp = plan.fsdp or {}
    mode = fsdp.get("mode") or ("fsdp" if fsdp.get("enabled") else "replicate")
    if mode not in ("fsdp", "zero1", "replicate"):
        raise PlanSchemaError(f"plan.fsdp.mode={mode!r} is not one of fsdp, zero1, replicate")
    return mode


class Zero1:
    """ZeRO-1 (Megatron-LM's distributed optimizer) over one data-parallel group.

    Parameters and gradients stay whole (TP-local) on every rank; the optimizer state and an
    fp32 master copy of the parameters are sharded. After backward the local gradients are
    flattened (in registration order, padded with zeros to a multiple of the group size) and
    reduce-scattered, so each rank receives the summed gradients of its contiguous 1/dp slice;
    it divides by dp, steps its slice (reduction and master weights in fp32, as Megatron-LM's
    distributed optimizer does for 16-bit models), and the updated slices are all-gathered back into the
    parameters. Two collectives of the padded flat size per step, issued exactly as the planner
    prices them (``CostContext.ddp_collectives``). The optimizer the runner holds only names the
    algorithm and hyper-parameters: its class and ``param_groups[0]`` settings are applied to
    the master slice (elementwise optimizers -- SGD, Adam, AdamW -- give the same update on a
    flat slice as on the tensors). Built lazily at the first step, so a plan applied on meta
    and materialised later (verify's dry run) works.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group, world: int, rank: int):
        self.params, self.group, self.world, self.rank = list(params), group, world, rank
        self.master: torch.Tensor | None = None
        self.inner: torch.optim.Optimizer | None = None
        self._outer = None

    def padded_numel(self) -> int:
        n = sum(_local(p).numel() for p in self.params)
        return -(-n // self.world) * self.world

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Reduce-scatter the gradients, step this rank's slice with ``optimizer``'s algorithm,
        all-gather the updated parameters."""
        if not self.params:
            return
        local = [_local(p) for p in self.params]
        total = self.padded_numel()
        shard = total // self.world
        dtype, device = local[0].dtype, local[0].device
        flat = torch.zeros(total, dtype=torch.float32, device=device)   # gradients reduced in fp32
        offset = 0
        for p, t in zip(self.params, local):
            if p.grad is not None:
                flat[offset:offset + t.numel()].copy_(_local(p.grad).reshape(-1))
            offset += t.numel()
        grad = torch.empty(shard, dtype=torch.float32, device=device)
        if self.world > 1:
            dist.reduce_scatter_single(grad, flat, group=self.group)
        else:   # one rank (the experts at dp 1 beside non-expert state sharded over ep): nothing to reduce
            grad.copy_(flat)
        if self.master is None or self._outer is not optimizer:
            self._build(optimizer, local, total, shard)
        for k, v in optimizer.param_groups[0].items():   # follow lr schedules on the outer optimizer
            if k != "params":
                self.inner.param_groups[0][k] = v
        self.master.grad = grad.div_(self.world)
        self.inner.step()
        gathered = torch.empty(total, dtype=dtype, device=device)
        if self.world > 1:
            dist.all_gather_single(gathered, self.master.detach().to(dtype), group=self.group)
        else:
            gathered.copy_(self.master.detach())
        offset = 0
        with torch.no_grad():
            for t in local:
                t.copy_(gathered[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _build(self, optimizer, local: list[torch.Tensor], total: int, shard: int) -> None:
        flat = torch.zeros(total, dtype=torch.float32, device=local[0].device)
        offset = 0
        with torch.no_grad():
            for t in local:
                flat[offset:offset + t.numel()].copy_(t.reshape(-1))
                offset += t.numel()
        self.master = torch.nn.Parameter(flat[self.rank * shard:(self.rank + 1) * shard].clone())
        accepted = inspect.signature(type(optimizer).__init__).parameters
        settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.inner = type(optimizer)([self.master], **settings)
        self._outer = optimizer


class Zero1Groups:
    """ZeRO-1 of a plan with an ep dimension: the parameters outside the experts over the
    flattened dp x ep mesh (their ranks hold the same parameters and different tokens, so one
    reduce-scatter averages them over every batch shard -- Megatron-Core's distributed optimizer
    over the whole data-parallel group, which contains ep), each rank's experts over dp (its ep
    shard differs from its ep peers'). Each is a :class:`Zero1` of its own flat buffer; the
    expert gradients were divided by ep before (``parallelisms.expert.ExpertGradSync``). The
    split is made at the first step, from the parameters the roots hold then (a plan applied on
    meta and materialised later -- verify's dry run -- holds other Parameter objects by then)."""

    def __init__(self, plan, target: ApplyTarget, mesh, over_ep):
        self.plan, self.target, self.mesh, self.over_ep = plan, target, mesh, over_ep
        self.parts: list[Zero1] | None = None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.parts is None:
            roots = self.target.roots
            experts = {id(p) for root in roots for m in expert_containers(root, self.plan) for p in m.parameters()}
            params = unique_params(*roots)
            self.parts = [Zero1([p for p in params if id(p) not in experts], self.over_ep.get_group(),
                                self.over_ep.size(), self.over_ep.get_local_rank()),
                          Zero1([p for p in params if id(p) in experts], self.mesh.get_group(), self.mesh.size(),
                                self.mesh.get_local_rank())]
        for part in self.parts:
            part.step(optimizer)


def zero1_of(plan, target: ApplyTarget, mesh, over_ep):
    """The ZeRO-1 state of ``target``'s roots: one :class:`Zero1` over the gradient mesh, or with
    ``over_ep`` (``state_mesh``: the flattened dp x ep mesh) a :class:`Zero1Groups` of the
    non-expert parameters over it and the experts over ``mesh`` (dp; one rank at dp 1). Says so in
    ``target.state["dense_over_ep"]`` (True: every non-expert parameter), so ExpertGradSync leaves
    them alone."""
    if over_ep is None:
        return Zero1(unique_params(*target.roots), mesh.get_group(), mesh.size(), mesh.get_local_rank())
    target.state["dense_over_ep"] = True
    return Zero1Groups(plan, target, mesh, over_ep)


# ---- registry entries --------------------------------------------------------------------------
_FSDP = {"type": "object", "required": ["enabled"], "additionalProperties": False,
         "properties": {"enabled": {"type": "boolean"}, "dim": {"type": ["string", "null"]},
                        "mode": {"enum": ["fsdp", "zero1", "replicate"]},
                        "mixed_precision": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
                        # FSDP2's overlap knobs: keep a block's gathered parameters from its forward to
                        # its backward (no re-gather, more memory), and gather the next ``prefetch``
                        # blocks ahead of the one running (explicit prefetch; 0: FSDP2's own order)
                        "reshard_after_forward": {"type": "boolean"},
                        "prefetch": {"type": "integer", "minimum": 0}}}


class DataParallel(Parallelism):
    """Data parallelism over the dp dimension: FSDP2 (``fully_shard`` on every repeated block and
    on each root), ZeRO-1 or replicated (one flat all-reduce after backward; the runner's step).
    Plan section ``parallel.dp``: ``dim`` and ``fsdp`` (enabled, mode, mixed precision). With an
    active ``hsdp`` section the same calls run on the 2-D (dp_replicate, dp_shard) mesh."""

    name = "dp"
    roles = ("dp",)
    order = 40
    schema = {"type": "object", "required": ["dim", "fsdp"], "additionalProperties": False,
              "properties": {"dim": {"type": ["string", "null"]}, "fsdp": _FSDP}}

    def default(self) -> dict:
        return {"dim": None, "fsdp": {"enabled": False}}

    def check(self, section, data, roles, degree) -> None:
        dim, fsdp = section["dim"], section["fsdp"]
        if dim is not None and dim != roles.get("dp"):
            raise section_error("dp", "dim", f"{dim!r} is not the mesh's dp dimension (mesh names {list(degree)}; "
                                f"expected {roles.get('dp')!r} or null)")
        if fsdp.get("dim") is not None and fsdp["dim"] != dim:
            raise section_error("dp", "fsdp/dim", f"{fsdp['dim']!r} is not the dp dimension {dim!r}")
        tuned = [k for k in ("reshard_after_forward", "prefetch") if k in fsdp]
        if tuned and not (fsdp["enabled"] and fsdp.get("mode", "fsdp") == "fsdp"):
            raise section_error("dp", f"fsdp/{tuned[0]}", f"{fsdp[tuned[0]]!r} is an FSDP option, but the plan's "
                                f"data parallel is {fsdp.get('mode') or 'replicate'}; valid: drop it, or FSDP")
        if fsdp["enabled"] and dim is None and not data["parallel"].get("cp"):
            # (with context parallelism FSDP shards over cp alone, as torchtitan's dp_shard x cp with dp_shard=1)
            raise section_error("dp", "fsdp/enabled", "true, but the plan has no dp (or cp) dimension to shard over")

    def active(self, plan) -> bool:
        return plan.dp_dim is not None

    def traffic_dims(self, plan) -> tuple[str, ...]:
        """The dp dimension and, under context parallelism, the flattened dp x cp one FSDP runs on;
        with an ep dimension under FSDP, the flattened dp x ep one its non-expert units run on."""
        dims = super().traffic_dims(plan)
        if dims and plan.parallel.get("cp"):
            dims += (flat_name(grad_dims(plan)),)
        if dims and plan_dp_mode(plan) in ("fsdp", "zero1") and state_dims(plan) != grad_dims(plan):
            dims += (flat_name(state_dims(plan)),)   # FSDP / ZeRO-1 of the non-expert parameters over dp x ep
        return dims

    def batch_ways(self, plan) -> int:
        return dp_degree(plan)

    def share_batch(self, applied: dict, inputs, targets, who: str):
        """Rows by this rank's data-parallel coordinate (row-major over HSDP's 2-D mesh)."""
        return dp_share(inputs, targets, applied.get("batch_mesh"), who)

    def after_backward(self, applied: dict, optimizer) -> bool:
        """ZeRO-1: reduce-scatter, step this rank's slice, all-gather (the optimizer has stepped);
        replicated dp: one all-reduce of every gradient; FSDP: one all-reduce of the parameters it
        left out (its own reductions ran inside backward)."""
        mesh, roots = applied.get("dp_mesh"), applied.get("dp_roots", ())
        if applied.get("zero1") is not None:   # (at dp 1 too where ep shards the non-expert state)
            applied["zero1"].step(optimizer)
            return True
        if mesh is None or mesh.size() == 1:
            return False
        if applied.get("dp_mode") == "replicate":
            allreduce_gradients(unique_params(*roots), mesh.get_group(), mesh.size())
        elif applied.get("fsdp_replicated"):
            allreduce_gradients(applied["fsdp_replicated"], dp_group(mesh), mesh.size())
        return False

    def apply_to_roots(self, plan, target: ApplyTarget) -> None:
        # 2-D (dp_replicate, dp_shard) for HSDP: FSDP2's HSDP; the flattened dp x cp with context parallel
        mesh = grad_mesh(plan, target.mesh)
        mode = plan_dp_mode(plan)
        target.state.update(dp_mesh=mesh, dp_mode=mode, batch_mesh=dp_mesh(plan, target.mesh),
                            dp_roots=list(target.roots))
        # with an ep dimension FSDP and ZeRO-1 shard the non-expert state over dp x ep, at dp 1 too
        over_ep = state_mesh(plan, target.mesh) if mode in ("fsdp", "zero1") else None
        if (mesh is None or mesh.size() == 1) and over_ep is None:
            return
        if mode == "zero1":   # the optimizer state sharded over dp (x ep); parameters stay whole
            target.state["zero1"] = zero1_of(plan, target, mesh, over_ep)
        if mode != "fsdp":
            return
        kw = fsdp_kwargs(plan.fsdp)   # mixed precision exactly as priced
        # parameters FSDP2 cannot shard (a packed projection's bias) stay replicated over dp: the
        # runner averages their gradients in one all-reduce after backward
        unshardable = [p for root in target.roots for p in fsdp_unshardable(root)]
        target.state["fsdp_replicated"] = unshardable
        ignored = set(target.ignored_params) | set(unshardable)
        dense = over_ep if over_ep is not None else mesh
        if over_ep is not None:
            # with an ep dimension: each experts container its own unit over dp (first, so the
            # blocks around it leave its parameters alone), everything else over dp x ep; the
            # parameters FSDP shards over dp x ep need no all-reduce over ep after backward
            # (ExpertGradSync skips them)
            for experts in (m for root in target.roots for m in expert_containers(root, plan)):
                if any(p not in ignored for p in experts.parameters()):
                    fully_shard(experts, mesh=mesh, ignored_params=ignored or None,
                                reshard_after_forward=plan.fsdp.get("reshard_after_forward", True), **kw)
        reshard = plan.fsdp.get("reshard_after_forward", True)
        for block in target.blocks:
            fully_shard(block, mesh=dense, ignored_params=ignored or None, reshard_after_forward=reshard, **kw)
        prefetch_blocks(target.blocks, int(plan.fsdp.get("prefetch", 0)))
        for root in target.roots:
            fully_shard(root, mesh=dense, ignored_params=ignored or None, **kw)
        if over_ep is not None:
            # the parameters FSDP over dp x ep leaves out (their gradients still need the all-reduce
            # over ep), by name: a materialization after apply (to_empty) makes new parameter objects
            left = {id(p) for p in ignored}
            target.state["dense_left_out"] = {name for root in target.roots
                                              for name, p in root.named_parameters() if id(p) in left}


class HybridShardedDataParallel(Parallelism):
    """HSDP: data parallel as dp_replicate x dp_shard -- parameters sharded within a dp_shard group,
    each group a replica, gradients reduce-scattered over dp_shard then all-reduced over
    dp_replicate. It adds a mesh dimension to data parallelism: ``DataParallel`` applies
    ``fully_shard`` on the 2-D mesh when this section is set. Plan section ``parallel.hsdp``: null,
    or ``dim`` (the mesh's dp_replicate dimension), ``replicate`` and ``shard`` degrees."""

    name = "hsdp"
    roles = ("dp_replicate",)
    order = 40
    schema = {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["dim", "replicate", "shard"], "additionalProperties": False,
        "properties": {"dim": {"$ref": "#/$defs/name"}, "replicate": {"$ref": "#/$defs/positive"},
                       "shard": {"$ref": "#/$defs/positive"}}}]}

    def check(self, section, data, roles, degree) -> None:
        if not self.check_own_dim(section, roles, degree):
            return
        rep_name = roles.get("dp_replicate")
        dp = data["parallel"]["dp"]
        if section["replicate"] != degree[rep_name] or section["shard"] != degree.get(dp["dim"], 0):
            raise section_error("hsdp", "", f"replicate={section['replicate']} x shard={section['shard']} is not the "
                                f"mesh's {rep_name} x {dp['dim']} ({degree})")
        if dp["fsdp"].get("mode", "fsdp") != "fsdp" or not dp["fsdp"]["enabled"]:
            raise section_error("hsdp", "", "hybrid sharding needs FSDP on the dp dimension (parallel/dp/fsdp)")

    def active(self, plan) -> bool:
        return bool(plan.parallel.get("hsdp"))
