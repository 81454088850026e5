"""Where the sequence sits in a module's input: dimension 1 of (batch, sequence, hidden), or 0 where
the model flattened the tokens first (OPT's decoder layer reshapes the stream to (tokens, hidden)
before its final norm and fc1/fc2). A sequence-sharded stream is sharded on that dimension there:
a flattened local shard (batch x sequence/tp, hidden) is the rank's tokens on dimension 0, and a
gather / reduce-scatter on dimension 0 concatenates and splits the ranks' tokens in the same order,
which is all a per-token unit needs (a norm, an MLP)."""
from __future__ import annotations


def token_dim(rows: dict, fqn: str) -> int:
    """The sequence's dimension in ``fqn``'s first input, from the captured shapes (1 if unknown)."""
    shapes = (rows.get(fqn) or {}).get("input_shapes") or []
    return 0 if shapes and len(tuple(shapes[0])) == 2 else 1
