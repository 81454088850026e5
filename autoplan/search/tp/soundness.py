"""Which candidate strategies survive a run on the model, and how they are repaired.

:class:`~autoplan.search.tp.probe.Prober` runs styled copies of the model; this module decides what
to run and what the runs mean for the search's candidates (``slots``: unit -> options).

Checking is lazy: the ILP solves over every candidate, and only what it *picks* is run
(:func:`settle`). A probe can only remove an option or make it dearer (a repair adds
collectives), so when the pick runs clean it is the optimum over the sound options too; when it
does not, its stream layout goes down the careful path -- the *base* assignment (every unit
replicated on that stream: on a sequence-sharded stream this alone shows whether modules the
planner does not shard would see a sequence shard, and the layout is dropped), then sets of
sharded options together (the k-th of every unit), each option of a failing set alone -- and the
ILP solves again. A sound model costs one run per tensor-parallel degree plus the shared
replicated reference. Verdicts are kept per degree (on the prober) for every later search.
Rejections carry their reason into the plan's notes.

The runs happen on a fake process group of the degree in a c10d world of its own
(:func:`hyper_parallel.local.fake_world`, isolated from the process's groups), so planning inside a
launched job -- after ``init_process_group``, on every rank -- checks exactly what planning offline
checks and gives the same plan, without a collective or any traffic on the job's groups. Where
that isolation cannot work the search raises :class:`~autoplan.errors.StrategyCheckError` instead
of planning without the checks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch.distributed.device_mesh import init_device_mesh

from autoplan.errors import InfeasiblePlanError, StrategyCheckError
from autoplan.search.tp.probe import Finding, Prober, repaired
from autoplan.search.tp.stream_entry import multi_stack_refusal
from hyper_parallel.errors import WorldIsolationError
from hyper_parallel.local import fake_world

log = logging.getLogger(__name__)


@dataclass
class SoundnessReport:
    """What the runs decided: rejected options (slot, strategy, stream, reason), dropped stream
    layouts with their reason, and the number of runs."""

    rejected: list[tuple[str, str, str, str]] = field(default_factory=list)
    dropped_layouts: dict[str, str] = field(default_factory=dict)
    runs: int = 0
    skipped: str | None = None
    seconds: float = 0.0

    def notes(self, structure=None) -> list[str]:
        out = [f"{fqn}: kept replicated: {why}" for fqn, why in (structure.not_units if structure else [])]
        out += [f"{fqn}: kept replicated: {n:,} parameters in linear layers outside every repeated block "
                f"group, embedding and head -- no unit plans them"
                for fqn, n in (structure.outside_units if structure else [])]
        out += [f"{unit}: {name} on a {stream} stream rejected: {why}" for unit, name, stream, why in self.rejected]
        out += [f"sequence-sharded stream ({lay}) not used: {why}" for lay, why in self.dropped_layouts.items()]
        if self.skipped:
            out.append(f"strategies not checked on the model: {self.skipped}")
        return out


# assignments tried, in order, as the "every unit replicated" base of a stream layout: on a
# sequence-sharded stream the stream norms must be sequence parallel, with a DTensor output
# (pre-norm blocks) or a local one (post-norm blocks). Last, the MLP sharded with an output it
# owns: a block that adds into the MLP's output in place (Falcon's parallel attention and MLP)
# cannot take the replicated MLP's output on S, a slice of the gathered result (a view).
_OWNED_MLP = {"mlp": "hidden_sharded_owned_output"}
BASE_PREFERENCES = {"R": ({},), "S": ({}, {"norms": "sequence_local", "final_norm": "sequence_local"}, _OWNED_MLP,
                                       dict(_OWNED_MLP, norms="sequence_local", final_norm="sequence_local"))}


class SlotChecker:
    """Checks ``search.slots`` of one TPSearch in place with ``prober`` (see module doc)."""

    def __init__(self, search, prober: Prober):
        self.search = search
        self.prober = prober
        self.report = prober.report if prober.report is not None else SoundnessReport()
        self.judged: set[tuple] = set()            # option keys the careful path decided
        self.units = self._unit_paths()
        self.repairs: dict[tuple, tuple] = {}   # option key -> (module -> dim, param bytes, forward collectives)
        self._base_assignment: dict = {}         # the layout's sound base, once found

    # -- naming -------------------------------------------------------------------------
    def _unit_paths(self) -> dict[str, str]:
        """slot -> FQN (in the shortened copy) of the module the slot's styles are rooted at."""
        st = self.search.structure
        out = {}
        for b in st.blocks:
            rep = self.prober.short(b.representative)
            for name, unit in (("attention", b.attention), ("cross_attention", b.cross_attention)):
                if unit is not None and unit.rel:
                    out[f"{b.id}/{name}"] = f"{rep}.{unit.rel}"
            if b.mlp is not None and b.mlp.rel:
                out[f"{b.id}/mlp"] = f"{rep}.{b.mlp.rel}"
            out[f"{b.id}/block"] = rep
        return out

    def _root(self, slot: str) -> str:
        return self.units.get(slot.split("/")[0] + "/block", "") if "/" in slot else ""

    def styles(self, assignment: dict) -> dict:
        out = {}
        for slot, o in assignment.items():
            root = self._root(slot)
            for rel, style in o.strategy.styles.items():
                out[f"{root}.{rel}" if root else rel] = style
        return out

    # -- assignments ----------------------------------------------------------------------
    def with_entry(self, assignment: dict, layout: str) -> dict:
        styles = self.styles(assignment)
        entry = self.search.entry(assignment.get("embedding"), layout)
        if entry is not None:
            styles.update(entry.styles)
        return styles

    # -- the runs ---------------------------------------------------------------------------
    def reference_fails(self, mesh) -> bool:
        """Run the unstyled copy once per model (shared by the probers of one search, see
        Prober.sibling); every sharded option is rejected when even that fails."""
        p = self.prober
        if p.reference is None:
            p.reference = p.run({}, mesh)
            self.report.runs += 1
        if p.reference.error:
            self.reject_all(f"the model does not run replicated on fake tensors ({p.reference.error})")
            return True
        return False

    def pick_is_clean(self, chosen: dict, layout: str, mesh) -> bool:
        """One run of the solver's whole pick: clean (no error, nothing to repair or reject)
        settles every option in it."""
        styles = self.with_entry(chosen, layout)
        if not styles:
            return True
        run = self.prober.run(styles, mesh)
        self.report.runs += 1
        return not run.error and not self.prober.findings(run)

    def check_layout(self, layout: str, mesh) -> None:
        """The careful path for one stream layout: find its sound base (every unit in its
        simplest form), then run the options no run has judged yet in sets (the k-th of every
        slot together), splitting a failing set into its options."""
        everything = self._sharded(layout)
        self.judged = {_key(slot, o) for slot, opts in everything.items() for o in opts}
        if not self._base(layout, mesh):
            return
        self.judged |= {_key(slot, o) for slot, o in self._base_assignment.items()}
        verdicts = self.prober.verdicts or {}
        sharded = {slot: [o for o in opts if _key(slot, o) not in verdicts] for slot, opts in everything.items()}
        depth = max((len(v) for v in sharded.values()), default=0)
        for k in range(depth):
            self._check_set(self._base_assignment, self._trial(sharded, k), layout, mesh)

    def _sharded(self, layout: str) -> dict:
        """Per slot, its sharded options on ``layout``, in the order they are tried."""
        return {slot: [o for o in opts if o.strategy.name != "replicate" and
                       (o.stream in (None, layout) or slot == "embedding") and
                       (slot != "embedding" or o.stream == layout or o.stream == "R")]
                for slot, opts in self.search.slots.items()}

    def _trial(self, sharded: dict, k: int) -> dict:
        """The k-th option of every slot that has one (fallbacks of live primaries left out); a
        tied partner without a k-th option takes its last live sharded one (see :meth:`_tied`)."""
        trial = {slot: opts[k] for slot, opts in sharded.items() if len(opts) > k and not self._primary_alive(slot, opts[k])}
        for slot in self._tied():
            if slot not in trial and any(x in trial for x in self._tied()):
                live = [o for o in sharded.get(slot, []) if o in self.search.slots.get(slot, [])]
                if live:
                    trial[slot] = live[-1]
        return trial

    def _tied(self) -> tuple[str, ...]:
        """Slots that share a parameter and so are sharded together or not at all: a tied
        embedding and head (``parallelize_module`` gives every holder of a replaced parameter the
        replacement, so a sharded table beside a replicated head would mix DTensor and Tensor)."""
        st = self.search.structure
        return ("embedding", "head") if st.head is not None and st.head.tied and st.embedding is not None else ()

    def _base(self, layout: str, mesh) -> bool:
        """Find a sound base assignment for ``layout`` (the stream layout with every unit in its
        simplest form); drop the layout when none runs clean."""
        p = self.prober
        base, bad = None, ""
        for prefer in BASE_PREFERENCES[layout]:
            try:
                base = self.search.assignment(layout, prefer)
            except InfeasiblePlanError as exc:  # a unit with no option on this stream
                bad = str(exc)
                break
            styles = self.with_entry(base, layout)
            run = p.run(styles, mesh) if styles else p.reference  # no styles: the reference run
            self.report.runs += bool(styles)
            bad = run.error or "; ".join(f.detail for f in p.findings(run))
            if not bad:
                break
        if bad:
            self._drop_layout(layout, bad)
            return False
        self._base_assignment = base
        return True

    def _primary_alive(self, slot: str, option) -> bool:
        """Whether ``option`` is a fallback whose primary (checked earlier: it comes first) is still
        a candidate, so the ILP would not pick the fallback (TPSearch._held_back)."""
        primary = option.strategy.extra.get("fallback_for")
        return primary is not None and any(o.strategy.name == primary and o.stream == option.stream
                                           for o in self.search.slots.get(slot, []))

    def _check_set(self, base: dict, trial: dict, layout: str, mesh, alone: bool = False,
                   keep: frozenset = frozenset()) -> str:
        """Run ``trial`` (slot -> option) over ``base``; repair what can be repaired (a run that
        fails may fail *because* of a module to repair: OLMo-2's q norm), split a failing set
        into its options, reject a failing option (not those of the slots in ``keep``). Returns
        why the set failed ("" when it passed)."""
        if not trial:
            return ""
        p = self.prober
        original = {slot: o.strategy for slot, o in trial.items()}
        fixes: dict[str, dict[str, int]] = {}
        pbytes: dict[str, list[int]] = {}
        for _ in range(4):
            run = p.run(self.with_entry(dict(base, **trial), layout), mesh)
            self.report.runs += 1
            pbytes.update({k: v for k, v in run.plain_param_modules.items() if k not in pbytes})
            new, unsound = False, []
            for f in p.findings(run):
                slot = self._owner_slot(f, trial)
                if slot is not None and f.dim is not None:
                    if f.module not in fixes.get(slot, {}):
                        fixes.setdefault(slot, {})[f.module] = f.dim
                        new = True
                else:
                    unsound.append(f)
            if not new:
                break
            for slot, mods in fixes.items():
                trial[slot].strategy = self.apply_repair(slot, original[slot], (mods, pbytes, {}, {}), 1)
        why = run.error or "; ".join(f.detail for f in unsound)
        if not why and fixes:  # the repaired set, forward and backward, its collectives recorded
            run = p.run(self.with_entry(dict(base, **trial), layout), mesh, record=True, backward=True)
            self.report.runs += 1
            why = run.error or "; ".join(f.detail for f in p.findings(run))
            for slot, mods in fixes.items():
                lone = {m: c for m, d in mods.items() if (c := p.lone_collectives(m, d, mesh)) is not None}
                fix = (mods, pbytes, run.forward_collectives, lone)
                self.repairs[_key(slot, trial[slot])] = fix
                trial[slot].strategy = self.apply_repair(slot, original[slot], fix, 1)
        if not why:
            return ""
        for slot, strategy in original.items():
            trial[slot].strategy = strategy
            self.repairs.pop(_key(slot, trial[slot]), None)
        if alone or len(trial) == 1:
            for slot, o in trial.items():
                if slot not in keep:
                    self._reject(slot, o, layout, why)
            return why
        tied = {slot: o for slot, o in trial.items() if slot in self._tied()}
        for slot, o in trial.items():
            if slot not in tied:
                self._check_set(base, {slot: o}, layout, mesh, alone=True)
        if tied:   # checked together: one alone beside its replicated partner cannot run
            self._check_tied(base, tied, layout, mesh)
        return why

    def _check_tied(self, base: dict, tied: dict, layout: str, mesh) -> None:
        """Check a tied embedding option with the head's: a head option that fails beside it is
        rejected; the embedding option only when it fails beside every live head option (BART's
        loss-parallel head fails on its logits bias, its vocabulary-sharded table does not)."""
        emb, head = tied.get("embedding"), tied.get("head")
        if emb is None or head is None:
            self._check_set(base, tied, layout, mesh, alone=True)
            return
        others = [o for o in self.search.slots.get("head", []) if o is not head and o.strategy.name != "replicate"
                  and o.stream in (None, layout) and not self._primary_alive("head", o)]
        why = ""
        for h in [head] + others:
            why = self._check_set(base, {"embedding": emb, "head": h}, layout, mesh, alone=True,
                                  keep=frozenset({"embedding"}))
            if not why:
                return
        self._reject("embedding", emb, layout, why)

    def apply_repair(self, slot: str, strategy, fix: tuple, batch: int):
        mods, param_bytes, forward, lone = fix
        root = self._root(slot)
        forward = {m: [c.scaled_bytes(batch) for c in cs] for m, cs in forward.items()}
        # activations scale with the batch the runs were for, weight gradients do not
        lone = {m: [c if c.weight_grad else c.scaled_bytes(batch) for c in cs] for m, cs in lone.items()}
        return repaired(strategy, mods, param_bytes, forward, lambda m: m[len(root) + 1:] if root else m, lone)

    def _owner_slot(self, f: Finding, trial: dict) -> str | None:
        best = None
        for slot in trial:
            root = self.units.get(slot)
            if root and (f.module == root or f.module.startswith(root + ".")):
                best = slot
        return best

    # -- outcomes ---------------------------------------------------------------------------
    def _reject(self, slot: str, option, layout: str, why: str) -> None:
        opts = self.search.slots.get(slot, [])
        if option in opts:
            opts.remove(option)
            self.report.rejected.append((self.search.unit_module(slot), option.strategy.name, layout, why))
            for o in opts:  # the replicated fallback says why it stays
                if o.strategy.name == "replicate" and o.stream in (None, layout):
                    _say_rejected(o.strategy, f"{option.strategy.name} rejected: {why}")
            log.info("%s: %s on %s rejected: %s", slot, option.strategy.name, layout, why)

    def _drop_layout(self, layout: str, why: str) -> None:
        if layout == "R":  # the replicated stream with every unit replicated must run
            self.reject_all(f"the replicated model fails under the planned styles ({why})")
            return
        self.report.dropped_layouts[layout] = why
        self.drop_layout_options(layout)

    def drop_layout_options(self, layout: str) -> None:
        """Remove ``layout`` and every option that only exists on it from the search."""
        self.search.layouts = tuple(x for x in self.search.layouts if x != layout)
        for slot, opts in self.search.slots.items():
            keep = [o for o in opts if o.stream != layout or (slot == "embedding" and o.stream == "R")]
            if slot == "embedding":
                keep = [o for o in opts if o.stream != layout]
            self.search.slots[slot] = keep

    def mark_rejected(self) -> None:
        """Say on each replicated fallback why the sharded options of its unit were rejected
        (by this search's runs or an earlier search's at the same degree)."""
        for unit, name, stream, why in self.report.rejected:
            slot = next((x for x in self.search.slots if self.search.unit_module(x) == unit), unit)
            for o in self.search.slots.get(slot, []):
                if o.strategy.name == "replicate" and o.stream in (None, stream):
                    _say_rejected(o.strategy, f"{name} rejected: {why}")

    def reject_all(self, why: str) -> None:
        self.report.skipped = why
        for slot, opts in self.search.slots.items():
            for o in list(opts):
                if o.strategy.name != "replicate" and o.strategy.name != "none":
                    self._reject(slot, o, o.stream or "R", why)
        if "S" in self.search.layouts:
            self._drop_layout("S", why)


def _say_rejected(replicated, text: str) -> None:
    """Add ``text`` to why a replicated fallback stays: after the reason the other forms were not
    offered (a fused [q|k|v] of unequal widths), the run that rejected the form that was (DBRX's
    kv-replicated attention, when the model does not run on fake tensors)."""
    before = replicated.extra.get("tp_excluded")
    if before is None:
        replicated.extra["tp_excluded"] = text
    elif text not in before:
        replicated.extra["tp_excluded"] = f"{before}; {text}"


def _key(slot: str, o) -> tuple:
    return slot, o.strategy.name, o.stream


def _batch(search) -> int:
    """Sequences per micro-batch of ``search`` (the probe runs one sequence; repairs scale)."""
    blk = search.structure.blocks[0] if search.structure.blocks else None
    if blk is None:
        return 1
    return max(1, blk.hidden_bytes // max(blk.seq_len * blk.dim * search.structure.dtype_bytes, 1))


def _shared(prober: Prober) -> tuple[dict, SoundnessReport]:
    """The verdicts and report every search at the prober's degree shares (set on first use)."""
    if prober.verdicts is None:
        prober.verdicts, prober.report = {}, SoundnessReport()
    return prober.verdicts, prober.report


def check_search(search, prober: Prober | None) -> SoundnessReport:
    """Prepare ``search.slots`` for lazy checking (:func:`settle` checks what the solver picks).

    What needs no run is decided here: a sequence-sharded stream is dropped when a module the
    planner does not plan would see a sequence shard, and the verdicts earlier searches at the
    same degree reached are applied -- rejected options leave, repaired ones are rescaled to this
    search's micro-batch. Options nobody has run stay candidates until the solver picks one."""
    if prober is None or search.tp <= 1:
        return SoundnessReport()
    verdicts, report = _shared(prober)
    checker = SlotChecker(search, prober)
    if "S" in search.layouts and search.structure.not_units and "S" not in report.dropped_layouts:
        where, why = search.structure.not_units[0]
        report.dropped_layouts["S"] = f"{where} is not planned as a unit ({why}) and would see a sequence shard"
    stacked = multi_stack_refusal(search.structure.blocks)
    if "S" in search.layouts and stacked and "S" not in report.dropped_layouts:
        report.dropped_layouts["S"] = stacked
    batch = _batch(search)
    for slot, opts in search.slots.items():
        kept = []
        for o in opts:
            k = _key(slot, o)
            if k in verdicts and verdicts[k] is None:
                continue
            if verdicts.get(k):
                o.strategy = checker.apply_repair(slot, o.strategy, verdicts[k], batch)
            kept.append(o)
        search.slots[slot] = kept
    checker.mark_rejected()
    for layout in list(search.layouts):
        if layout in report.dropped_layouts:
            checker.drop_layout_options(layout)
    return report


def settle(search, chosen: dict, layout: str) -> bool:
    """Check the options of the solver's pick that no run has judged yet. One run of the whole
    pick settles a sound model; a pick that fails or needs a repair sends its stream layout down
    the careful path (:meth:`SlotChecker.check_layout`). Returns whether ``search.slots`` changed
    (then the ILP must be solved again: its pick is gone or costs more)."""
    prober = search.prober
    if prober is None or search.tp <= 1:
        return False
    verdicts, report = _shared(prober)
    pending = {slot: o for slot, o in chosen.items() if o.strategy.styles and _key(slot, o) not in verdicts}
    if not pending:
        return False
    checker = SlotChecker(search, prober)
    before = {_key(slot, o) for slot, opts in search.slots.items() for o in opts}
    t0 = time.perf_counter()
    try:
        with fake_world(search.tp):   # a world of its own: also inside a launched job (see module doc)
            mesh = init_device_mesh("cpu", (search.tp,), mesh_dim_names=("tp",))
            if checker.reference_fails(mesh):
                pass   # every sharded option rejected, the reason in the report
            elif checker.pick_is_clean(chosen, layout, mesh):
                verdicts.update({_key(slot, o): () for slot, o in pending.items()})
            else:
                checker.check_layout(layout, mesh)
    except WorldIsolationError as e:   # refuse rather than plan without the checks
        raise StrategyCheckError(
            f"autoplan: the sharded strategies at tp={search.tp} cannot be checked on the model in this process "
            f"({e}); plan in a separate process (plan.to_json) and load the plan file on every rank, or plan "
            f"where the c10d world is torch's own") from e
    report.seconds += time.perf_counter() - t0
    after = {_key(slot, o) for slot, opts in search.slots.items() for o in opts}
    for k in before - after:
        verdicts[k] = None
    for k in checker.judged & after:
        verdicts.setdefault(k, checker.repairs.get(k, ()))
    batch = _batch(search)
    if batch != 1:  # the runs were for one sequence: rescale the repairs
        for slot, opts in search.slots.items():
            for o in opts:
                fix = checker.repairs.get(_key(slot, o))
                if fix:
                    o.strategy = checker.apply_repair(slot, _unrepaired(o.strategy), fix, batch)
    return before != after or bool(checker.repairs)


def _unrepaired(strategy):
    return strategy.extra.get("unrepaired", strategy)
