"""Model parts no planner unit covers: linear layers outside every repeated block group, the
embedding, the head and the final norms (a second stack that forms no block group, a lone
global layer, a projector). They stay replicated; a plan names them in its notes and
``allow_replicated_units=False`` refuses a whole part left out (search/tp/search.py), so a model
part is never silently missing from a plan (Mllama's language model once was)."""
from __future__ import annotations

from autoplan.capture.ir import ModelGraph
from hyper_parallel.core.tensor_parallel.linear_styles import CONV1D

_SHARDABLE_LINEARS = ("torch.nn.modules.linear.Linear", CONV1D)


# a part of the model below this share of its parameters is not worth a note (a projector's bias,
# a pooler): what matters is a stack or a tower the plan would silently leave out
_OUTSIDE_SHARE = 0.01


def outside_units(graph: ModelGraph, covered: list[str]) -> list[tuple[str, int]]:
    """Linear layers that run in the traced step, in no block group and not the embedding, head or
    final norms, grouped under
    the child of the root-most module that holds only such layers, with their parameter count;
    only parts holding at least 1 % of the model's parameters."""
    def inside(fqn: str, prefixes: list[str]) -> bool:
        return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)

    loose = {fqn: info.num_params for fqn, info in graph.modules.items()
             if info.nn_base in _SHARDABLE_LINEARS and info.block is None and info.num_params
             and not inside(fqn, covered) and graph.nodes_in(fqn)}   # run in the step (SigLIP's unused head is not)
    if not loose:
        return []
    # the largest ancestor whose linear layers are all loose ones: one entry per model part
    linears = [fqn for fqn, info in graph.modules.items() if info.nn_base in _SHARDABLE_LINEARS]

    def part(fqn: str) -> str:
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):
            anc = ".".join(parts[:i])
            if all(x in loose for x in linears if inside(x, [anc])):
                return anc
        return fqn

    sizes: dict[str, int] = {}
    for fqn, n in loose.items():
        key = part(fqn)
        sizes[key] = sizes.get(key, 0) + n
    floor = _OUTSIDE_SHARE * max(graph.num_parameters, 1)
    return sorted(((k, n) for k, n in sizes.items() if n >= floor), key=lambda kv: -kv[1])


def norms_after_blocks(graph, norms: list[str]) -> tuple[list[str], list[str]]:
    """The stream norms outside every block split by where they run: after the blocks (the final
    norm, planned with the head's stream) and before the first block (an embedding norm, which
    sees the stream before any unit may shard it). A later block stack's embedding norm (BART's
    ``model.decoder.layernorm_embedding``, inside the decoder and run before its first block)
    is one too: that stack enters the stream at its first block, as the first stack does."""
    first_block = next((i for i, n in enumerate(graph.nodes) if n.block is not None), None)
    if first_block is None:
        return norms, []
    # each later stack's module (the parent of its blocks' prefix) and where its blocks start
    starts: dict[str, int] = {}
    for g in graph.blocks:
        holder = g.prefix.rpartition(".")[0]
        at = next((i for i, n in enumerate(graph.nodes) if n.block == g.id), None)
        if holder and at is not None:
            starts[holder] = min(starts.get(holder, at), at)
    before = []
    for norm in norms:
        at = next((i for i, n in enumerate(graph.nodes) if n.module == norm or n.module.startswith(norm + ".")),
                  None)
        if at is None:
            continue
        if at < first_block or any(norm.startswith(holder + ".") and at < start for holder, start in starts.items()):
            before.append(norm)
    return [n for n in norms if n not in before], before
