"""Token batches with a position that a checkpoint can restore.

Every rank reads the same *global* batch for a step and keeps its data-parallel share
(``runner.local_batch``), so the data a step sees does not depend on the plan: a run resumed
under another dp degree continues with exactly the batches the uninterrupted run would have seen.
The position is one integer (``state()``/``restore()``): the synthetic stream derives batch ``i``
from ``(seed, i)``; a file stream reads consecutive windows of ``batch * (seq + 1)`` tokens and
wraps around at the end.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import torch

from autoplan.train.errors import DataError

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class TokenStream(ABC):
    """``next() -> (inputs, targets)``, each ``(batch, seq)`` int64; ``targets`` are ``inputs`` shifted by one."""

    def __init__(self, batch: int, seq: int):
        self.batch, self.seq, self.position = batch, seq, 0

    @abstractmethod
    def _window(self, position: int) -> torch.Tensor:
        """Global batch number ``position`` as ``(batch, seq + 1)`` token ids."""

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._window(self.position)
        self.position += 1
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def state(self) -> dict:
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])


class SyntheticTokens(TokenStream):
    """Arithmetic sequences of token ids (random start, random stride 1..7, modulo the vocabulary),
    batch ``i`` a pure function of ``(seed, i)``. Learnable from context, so a working run shows
    its loss falling well below log(vocab) within a few dozen steps; no file needed."""

    def __init__(self, batch: int, seq: int, vocab: int, seed: int = 0):
        super().__init__(batch, seq)
        self.vocab, self.seed = vocab, seed

    def _window(self, position: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=g)
        stride = torch.randint(1, 8, (self.batch, 1), generator=g)
        return (start + stride * torch.arange(self.seq + 1)) % self.vocab


class FileTokens(TokenStream):
    """Consecutive windows over a 1-D array of token ids (memory-mapped where the format allows)."""

    def __init__(self, tokens, batch: int, seq: int, vocab: int, source: str):
        super().__init__(batch, seq)
        self.tokens, self.source = tokens, source
        need = batch * (seq + 1)
        if len(tokens) < need:
            raise DataError(f"train: --data {source}: {len(tokens)} tokens, one batch needs {need} "
                            f"(batch {batch} x (seq {seq} + 1)); use a longer file or a smaller --batch/--seq")
        top = int(tokens.max())
        if top >= vocab:
            raise DataError(f"train: --data {source}: token id {top} >= the model's vocabulary {vocab}")

    def _window(self, position: int) -> torch.Tensor:
        need = self.batch * (self.seq + 1)
        per_epoch = len(self.tokens) // need
        start = (position % per_epoch) * need
        chunk = np.asarray(self.tokens[start:start + need], dtype=np.int64)
        return torch.from_numpy(chunk).view(self.batch, self.seq + 1)


def _tokenize(path: Path, tokenizer: str) -> np.ndarray:
    text = path.read_text(encoding="utf-8")
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    tok_path = Path(tokenizer)
    if tok_path.is_file():
        from tokenizers import Tokenizer

        return np.asarray(Tokenizer.from_file(str(tok_path)).encode(text).ids, dtype=np.int64)
    if tok_path.is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_path), local_files_only=True)
        return np.asarray(tok(text)["input_ids"], dtype=np.int64)
    raise DataError(f"train: --tokenizer {tokenizer!r}: use 'bytes', a tokenizer.json file or a local "
                    "tokenizer directory (nothing is downloaded)")


def token_stream(data: str, *, batch: int, seq: int, vocab: int, seed: int = 0, tokenizer: str = "bytes",
                 token_dtype: str = "uint16") -> TokenStream:
    """``data``: ``synthetic``, a token-id file (``.npy``, ``.pt``, raw ``.bin`` of ``token_dtype``)
    or a text file (``.txt``/``.md``/``.jsonl`` read as text) tokenised by ``tokenizer``."""
    if data == "synthetic":
        return SyntheticTokens(batch, seq, vocab, seed)
    path = Path(data)
    if not path.is_file():
        raise DataError(f"train: --data {data!r}: not 'synthetic' and no such file")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        tokens = np.load(path, mmap_mode="r").reshape(-1)
    elif suffix == ".pt":
        tokens = torch.load(path, weights_only=True).reshape(-1).numpy()
    elif suffix == ".bin":
        if token_dtype not in _DTYPES:
            raise DataError(f"train: --token-dtype {token_dtype!r}: use one of {sorted(_DTYPES)}")
        tokens = np.memmap(path, dtype=_DTYPES[token_dtype], mode="r")
    else:
        tokens = _tokenize(path, tokenizer)
    return FileTokens(tokens, batch, seq, vocab, data)
