"""Activation bytes saved for backward, per layer, under any TP / SP layout and recomputation.

A layer is described by the tensors autograd keeps (:class:`SavedActivation`), each sized for the
whole micro-batch and tagged with the region that decides how tensor parallelism divides it:

- ``tp``: inside the tensor-parallel region (heads or FFN columns): divided by tp.
- ``seq``: norms, residual adds, dropouts on the residual stream: replicated under TP, divided by tp
  under sequence parallelism.
- ``gathered``: the input of a column-parallel linear. Replicated under TP. Under SP, Megatron keeps
  the sequence shard and re-gathers it in backward (divided by tp); torch DTensor keeps the
  all-gathered tensor (not divided). ``sp_regather`` chooses.
- ``replicated``: never divided (e.g. a RoPE table).

The same list serves the planner (sizes from the ModelGraph's per-module saved bytes) and the
closed forms of Korthikanti et al. 2022 (:func:`gpt_layer_activations`) that tests check against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

Region = Literal["tp", "seq", "gathered", "replicated"]
Checkpoint = Literal["none", "selective", "full"]
_REGIONS = ("tp", "seq", "gathered", "replicated")


@dataclass(frozen=True)
class SavedActivation:
    """One tensor kept for backward: ``nbytes`` for the full micro-batch on one unsharded device."""

    name: str
    nbytes: float
    region: Region
    recompute: bool = False     # dropped by selective recomputation (attention scores and the like)
    layer_input: bool = False   # the one tensor full recomputation keeps
    checkpoint_nbytes: float | None = None  # what full recomputation keeps of it (default nbytes),
                                            # e.g. the 16-bit block input where the layer saves an fp32 copy

    def __post_init__(self) -> None:
        if self.region not in _REGIONS:
            raise ValueError(f"SavedActivation {self.name!r}: region={self.region!r} not in {_REGIONS}")
        if self.nbytes < 0:
            raise ValueError(f"SavedActivation {self.name!r}: nbytes={self.nbytes} must be >= 0")

    def per_rank(self, tp: int, sequence_parallel: bool, sp_regather: bool, checkpointed: bool = False) -> float:
        nbytes = self.checkpoint_nbytes if (checkpointed and self.checkpoint_nbytes is not None) else self.nbytes
        if self.region == "tp":
            return nbytes / tp
        if self.region == "seq":
            return nbytes / tp if sequence_parallel else nbytes
        if self.region == "gathered":
            return nbytes / tp if (sequence_parallel and sp_regather) else nbytes
        return nbytes


def activation_bytes(items: Iterable[SavedActivation], tp: int = 1, sequence_parallel: bool = False,
                     checkpoint: Checkpoint = "none", sp_regather: bool = True) -> float:
    """Bytes one rank keeps for backward for one layer and one micro-batch.

    ``full`` keeps only the tensors flagged ``layer_input`` (the rest is recomputed in backward);
    ``selective`` drops the tensors flagged ``recompute``.
    """
    if tp < 1:
        raise ValueError(f"activation_bytes: tp={tp} must be >= 1")
    if checkpoint not in ("none", "selective", "full"):
        raise ValueError(f"activation_bytes: checkpoint={checkpoint!r} not in none/selective/full")
    total = 0.0
    for it in items:
        if checkpoint == "full" and not it.layer_input:
            continue
        if checkpoint == "selective" and it.recompute:
            continue
        total += it.per_rank(tp, sequence_parallel, sp_regather, checkpointed=checkpoint == "full")
    return total


def gpt_layer_activations(s: int, b: int, h: int, a: int) -> list[SavedActivation]:
    """Korthikanti et al. 2022's accounting of a GPT layer (16-bit activations, 1-byte dropout masks).

    Attention 11sbh + 5as^2b, MLP 19sbh, two layer norms 4sbh; total sbh(34 + 5as/h).
    """
    sbh = s * b * h
    return [
        SavedActivation("ln1_input", 2 * sbh, "seq", layer_input=True),
        SavedActivation("qkv_input", 2 * sbh, "gathered"),
        SavedActivation("q_and_k", 4 * sbh, "tp"),
        SavedActivation("softmax_output", 2 * a * s * s * b, "tp", recompute=True),
        SavedActivation("softmax_dropout_mask", a * s * s * b, "tp", recompute=True),
        SavedActivation("attn_dropout_output", 2 * a * s * s * b, "tp", recompute=True),
        SavedActivation("v", 2 * sbh, "tp"),
        SavedActivation("proj_input", 2 * sbh, "tp"),
        SavedActivation("attn_dropout_mask", sbh, "seq"),
        SavedActivation("ln2_input", 2 * sbh, "seq"),
        SavedActivation("fc1_input", 2 * sbh, "gathered"),
        SavedActivation("gelu_input", 8 * sbh, "tp"),
        SavedActivation("fc2_input", 8 * sbh, "tp"),
        SavedActivation("mlp_dropout_mask", sbh, "seq"),
    ]


def llama_block_activations(b: int, s: int, dim: int, n_heads: int, n_kv_heads: int, ffn_hidden: int,
                            act_bytes: int = 2, rope_table_elems: int = 0,
                            flash_attention: bool = True) -> list[SavedActivation]:
    """What autograd keeps for one block of the repo's torchtitan-style Llama (autoplan.models.llama).

    Derived from the block's code and checked against saved-tensor hooks (benchmarks/cost_accuracy.py):
    each RMSNorm keeps its input upcast to fp32 (twice for 16-bit inputs: the code upcasts twice
    and each copy is saved by a different op), the fp32 rsqrt per token and the normalised tensor
    in the activation dtype, and its output is kept once by the projections that read it; SDPA
    (flash kernel) keeps q, k, v as it sees them (k and v repeated to all query heads under GQA),
    its output (which is also wo's input) and an fp32 log-sum-exp per head and token; SwiGLU keeps
    w1's and w3's outputs, silu's output and the product read by w2.
    """
    tokens = b * s
    head_dim = dim // n_heads
    # k and v reach SDPA repeated to every query head, so both are as wide as q whatever n_kv_heads is
    kv_width = n_heads * head_dim
    # RMSNorm calls x.float() twice: one tensor when x is already fp32, two separate copies otherwise
    upcasts = 1 if act_bytes == 4 else 2
    items = []
    for norm, first in (("attention_norm", True), ("ffn_norm", False)):
        items += [
            SavedActivation(f"{norm}.input_fp32", 4 * tokens * dim, "seq", layer_input=first,
                            checkpoint_nbytes=act_bytes * tokens * dim)]
        if upcasts == 2:
            items.append(SavedActivation(f"{norm}.input_fp32_copy", 4 * tokens * dim, "seq"))
        items += [
            SavedActivation(f"{norm}.rsqrt", 4 * tokens, "seq"),
            SavedActivation(f"{norm}.normed", act_bytes * tokens * dim, "seq"),
            SavedActivation(f"{norm}.output", act_bytes * tokens * dim, "gathered"),
        ]
    items += [
        SavedActivation("attention.q", act_bytes * tokens * dim, "tp"),
        SavedActivation("attention.k", act_bytes * tokens * kv_width, "tp"),
        SavedActivation("attention.v", act_bytes * tokens * kv_width, "tp"),
        SavedActivation("attention.out", act_bytes * tokens * dim, "tp"),
        SavedActivation("feed_forward.w1_out", act_bytes * tokens * ffn_hidden, "tp"),
        SavedActivation("feed_forward.w3_out", act_bytes * tokens * ffn_hidden, "tp"),
        SavedActivation("feed_forward.silu_out", act_bytes * tokens * ffn_hidden, "tp"),
        SavedActivation("feed_forward.w2_input", act_bytes * tokens * ffn_hidden, "tp"),
    ]
    if flash_attention:
        items.append(SavedActivation("attention.logsumexp", 4 * tokens * n_heads, "tp"))
    else:  # math attention keeps the (b, heads, s, s) probabilities
        items.append(SavedActivation("attention.probs", act_bytes * b * n_heads * s * s, "tp", recompute=True))
    if rope_table_elems:
        items.append(SavedActivation("rope_table", 4 * rope_table_elems, "replicated"))
    return items


def default_region(fqn: str, style: str | None) -> Region:
    """Where a module's saved tensors live under a TP plan, from the module's style.

    Sequence-parallel modules and unstyled norms or block roots work on the residual stream
    (``seq``); a column-wise linear saves its (gathered) input; a row-wise linear saves its sharded
    input (``tp``); other unstyled modules inside a block (attention core, activation functions)
    work on head / column shards (``tp``).
    """
    key = (style or "").lower().replace("parallel", "").replace("_", "")
    if key in ("sequence", "sequenceparallel", "sp"):
        return "seq"
    if key.startswith("colwise"):
        return "gathered"
    if key.startswith("rowwise"):
        return "tp"
    leaf = fqn.rsplit(".", 1)[-1]
    if "norm" in leaf or fqn == "" or leaf.isdigit():
        return "seq"
    return "tp"


def activations_from_modules(saved: dict[str, float], styles: dict[str, str] | None = None, prefix: str = "",
                             layer_input_bytes: float = 0.0, region_of=default_region) -> list[SavedActivation]:
    """SavedActivation list from measured bytes per module (e.g. :func:`cost_models.saved_bytes.saved_bytes_by_module`
    on fake tensors) and a TP plan {fnmatch pattern of FQN: style name}.

    ``prefix`` turns the measured names into the plan's FQNs (``"layers.0."`` for a block);
    ``layer_input_bytes`` is what full recomputation keeps (the block input).
    """
    import fnmatch

    plan = dict(styles or {})
    items = []
    for name, nbytes in saved.items():
        if name == "<replicated>":
            items.append(SavedActivation(name, float(nbytes), "replicated"))
            continue
        fqn = (prefix + name).rstrip(".")
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(fqn, pat)), None)
        items.append(SavedActivation(fqn or "<root>", float(nbytes), region_of(fqn, style)))
    if layer_input_bytes:
        items.append(SavedActivation("layer_input", 0.0, "seq", layer_input=True, checkpoint_nbytes=layer_input_bytes))
    return items
