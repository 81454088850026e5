"""Image-text data for fine-tuning a vision-language checkpoint: a local set, the model's processor.

Two local formats, chosen by what ``--data`` names (docs/training.md, "Images"):

- a ``.jsonl`` file, one ``{"image": PATH, "text": STR}`` object a line, ``PATH`` relative to the
  file's folder (or absolute);
- a folder of images (``.png .jpg .jpeg .webp .bmp .gif``), each with the ``.txt`` of the same
  stem beside it.

The order is the file's (the folder's: sorted names); global batch ``i`` holds pairs
``i * batch ... i * batch + batch - 1`` modulo the set's size, so a run's data is a function of
its position alone (what a checkpoint restores, as for token data).

Every sample goes through the model's own processor (``AutoProcessor`` from the checkpoint
directory), one sample at a time, and is collated afterwards. A batch is split over the
data-parallel ranks by *sample*, before collation: each rank processes and collates only its own
rows. That is what keeps families whose image tensors are not batch-major right -- Qwen2-VL's
``pixel_values`` are every image's patch rows concatenated, with ``image_grid_thw`` saying how
many belong to which image, so the rows of a batch cannot be cut out of the collated tensor by
index, but the concatenation of each rank's own samples is exactly its share. Collation is
generic: sequence tensors (``(1, length)``: ids, masks, token types) are right-padded to
``--seq`` and stacked, everything else is concatenated along dim 0, zero-padding trailing dims
that differ (as processors pad tiles within a batch).

The loss is the mean over the *global* batch's counted tokens: a target is ignored where the next
token is padding or an image/vision placeholder. Each rank's count differs (captions differ in
length), so a per-rank mean averaged over dp would not be the one-device mean; the counts are
summed over the ranks that split the batch and each rank's loss is its token sum over that global
count, times the number of batch shards (the gradient reduction averages over them).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.train.config import DATA_FORMATS
from autoplan.train.errors import DataError, TrainConfigError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
IGNORE = -100


@dataclass(frozen=True)
class Pair:
    """One sample: its image file, its text, and where it was read (for errors)."""
    image: Path
    text: str
    where: str


def _jsonl_pairs(path: Path) -> list[Pair]:
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"train: --data {where}: not JSON ({e.msg}); each line must be "
                            '{"image": "path/relative/to/the/file.png", "text": "..."}') from None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not isinstance(row.get("text"), str):
            raise DataError(f"train: --data {where}: {line[:120]!r}; each line must be an object with a string "
                            '"image" (a path relative to the file) and a string "text"')
        image = Path(row["image"])
        image = image if image.is_absolute() else path.parent / image
        if not image.is_file():
            raise DataError(f"train: --data {where}: image {row['image']!r}: no such file ({image})")
        pairs.append(Pair(image, row["text"], where))
    return pairs


def _folder_pairs(folder: Path) -> list[Pair]:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    stems = {p.stem for p in images}
    orphans = [p.name for p in files if p.suffix == ".txt" and p.stem not in stems]
    if orphans:
        raise DataError(f"train: --data {folder}: text {orphans[0]!r} has no image of the same name (looked for "
                        f"{', '.join(orphans[0][:-4] + s for s in IMAGE_SUFFIXES)})")
    pairs = []
    for image in images:
        text = image.with_suffix(".txt")
        if not text.is_file():
            raise DataError(f"train: --data {folder}: image {image.name!r} has no text {text.name!r} beside it")
        pairs.append(Pair(image, text.read_text(encoding="utf-8").strip(), str(image)))
    if len(stems) != len(images):
        raise DataError(f"train: --data {folder}: two images share a name stem; each image needs its own .txt")
    return pairs


def read_pairs(data: str) -> list[Pair]:
    """The samples of a local image-text set (a ``.jsonl`` file or a folder), in their order."""
    path = Path(data)
    if path.is_dir():
        pairs = _folder_pairs(path)
    elif path.is_file() and path.suffix.lower() == ".jsonl":
        pairs = _jsonl_pairs(path)
    elif path.exists():
        raise DataError(f"train: --data {data!r} with --data-format image-text: not a .jsonl file or a folder; "
                        'valid: a .jsonl of {"image": path, "text": str} lines, or a folder of images with '
                        "a .txt of the same name each")
    else:
        raise DataError(f"train: --data {data!r}: no such file or folder")
    if not pairs:
        raise DataError(f"train: --data {data!r}: no image-text pairs found (a folder needs images "
                        f"{'/'.join(IMAGE_SUFFIXES)} with .txt beside them; a .jsonl needs lines)")
    return pairs


def is_image_text(data: str) -> bool:
    """Whether ``--data-format auto`` reads ``data`` as image-text: a folder, or a ``.jsonl`` whose
    first line is an object with an ``"image"`` key (other ``.jsonl`` files stay text)."""
    path = Path(data)
    if path.is_dir():
        return True
    if not (path.is_file() and path.suffix.lower() == ".jsonl"):
        return False
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "image" in row


def data_format(cfg) -> str:
    """``tokens`` or ``image-text``: ``cfg.data_format``, or for ``auto`` what ``cfg.data`` holds."""
    if cfg.data_format not in DATA_FORMATS:
        raise DataError(f"train: --data-format {cfg.data_format!r}: valid: {', '.join(DATA_FORMATS)}")
    if cfg.data_format != "auto":
        return cfg.data_format
    return "image-text" if cfg.data != "synthetic" and is_image_text(cfg.data) else "tokens"


def load_processor(cfg):
    """The model's processor: ``AutoProcessor`` from ``--tokenizer DIR`` if given, else from the
    ``--model`` directory (``processor.save_pretrained(dir)`` writes it beside the weights).
    Local files only; transformers' informational load messages are kept below warning level."""
    source = cfg.tokenizer if cfg.tokenizer != "bytes" else cfg.model
    folder = Path(source)
    folder = folder.parent if folder.suffix == ".json" and folder.is_file() else folder
    if not folder.is_dir():
        flag = f"--tokenizer {cfg.tokenizer!r}" if cfg.tokenizer != "bytes" else f"--model {cfg.model!r}"
        raise DataError(f"train: --data {cfg.data!r} is image-text, which needs the model's processor: {flag} "
                        "is not a save_pretrained directory; give one holding the processor "
                        "(processor.save_pretrained(dir)) or --tokenizer PROCESSOR_DIR")
    import transformers
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        processor = transformers.AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; each becomes one typed line
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"train: --data {cfg.data!r} is image-text, which needs the model's processor: "
                        f"AutoProcessor could not load one from {str(folder)!r} ({type(e).__name__}: {cause}); "
                        "save it there with processor.save_pretrained(dir), or give --tokenizer PROCESSOR_DIR") from None
    finally:
        hf_logging.set_verbosity(level)
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise DataError(f"train: {str(folder)!r} holds a {type(processor).__name__}, not a processor with an image "
                        "processor and a tokenizer; image-text data needs the model's multimodal processor "
                        "(e.g. LlavaProcessor, Qwen2VLProcessor) saved there")
    return processor


def placeholder_ids(processor, config) -> set[int]:
    """Token ids that stand for image content: the processor's image token and the model config's
    image/vision/video token ids (Qwen-VL's vision start and end among them). Their targets are
    not text to predict."""
    ids = {getattr(processor, "image_token_id", None)}
    for cfg in (config, getattr(config, "text_config", None)):
        for name, value in (vars(cfg).items() if cfg is not None else ()):
            if isinstance(value, int) and name.endswith(("token_id", "token_index")) and \
                    any(k in name for k in ("image", "vision", "video")):
                ids.add(value)
    return {i for i in ids if isinstance(i, int) and i >= 0}


def _sequence_key(key: str, value, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and tuple(value.shape) == (1, length) \
        and not key.startswith(("pixel", "image", "video"))


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    pad = []
    for have, want in zip(reversed(t.shape[1:]), reversed(shape)):
        pad += [0, want - have]
    return F.pad(t, pad) if any(pad) else t


def collate(samples: list[dict[str, Any]], seq: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One rank's rows: sequence tensors right-padded to ``seq`` (ids with ``pad_id``, the rest
    with 0) and stacked; every other tensor concatenated along dim 0, trailing dims zero-padded
    to the largest (see the module doc)."""
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if all(_sequence_key(key, v, s["input_ids"].shape[1]) for v, s in zip(values, samples)):
            fill = pad_id if key == "input_ids" else 0
            out[key] = torch.cat([F.pad(v, (0, seq - v.shape[1]), value=fill) for v in values])
        elif all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
            dims = max(v.dim() for v in values)
            if any(v.dim() != dims for v in values):
                raise DataError(f"train: the processor's {key!r} has {sorted({v.dim() for v in values})} dims "
                                "across samples; image-text samples must give tensors of one rank")
            shape = tuple(max(v.shape[d] for v in values) for d in range(1, dims))
            out[key] = torch.cat([_pad_to(v, shape) for v in values])
        else:
            raise DataError(f"train: the processor returned {key!r} as {type(values[0]).__name__}; image-text "
                            "training collates tensors only (return_tensors='pt')")
    return out


def targets_of(input_ids: torch.Tensor, attention_mask: torch.Tensor, ignore: set[int]) -> torch.Tensor:
    """Next-token targets, ``IGNORE`` where the next token is padding or an image placeholder and
    at the last position."""
    nxt = torch.full_like(input_ids, IGNORE)
    nxt[:, :-1] = input_ids[:, 1:]
    keep = torch.zeros_like(input_ids, dtype=torch.bool)
    keep[:, :-1] = attention_mask[:, 1:].bool()
    if ignore:
        keep &= ~torch.isin(nxt, torch.tensor(sorted(ignore), dtype=nxt.dtype))
    return nxt.masked_fill(~keep, IGNORE)


class ImageTextBatches:
    """This rank's rows of each global batch, processed and collated; ``next()`` -> ``(inputs,
    targets, extra)`` with ``extra`` the model's other inputs for those rows. ``rows``: this
    rank's row numbers within a global batch (``runner.local_batch`` of ``0..batch-1``)."""

    def __init__(self, pairs: list[Pair], processor, *, batch: int, seq: int, rows: list[int], ignore: set[int],
                 source: str):
        self.pairs, self.processor, self.batch, self.seq = pairs, processor, batch, seq
        self.rows, self.ignore, self.source, self.position = list(rows), set(ignore), source, 0
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.pad_id is None:
            raise DataError(f"train: --data {source!r}: the processor's tokenizer has neither a pad nor an eos token "
                            "to pad rows with; set tokenizer.pad_token and save the processor again")
        self.image_token = getattr(processor, "image_token", None)
        if not self.image_token:
            raise DataError(f"train: the processor {type(processor).__name__} names no image_token; image-text "
                            "training places the processor's image token before each text")
        self.eos = tok.eos_token or ""

    def indices(self, position: int) -> list[int]:
        """The pairs of global batch ``position``, in row order."""
        n = len(self.pairs)
        return [(position * self.batch + j) % n for j in range(self.batch)]

    def prompt(self, text: str) -> str:
        """The processor's image token first (unless the text places it), the text, then eos: the
        model learns the caption of the image and where it ends."""
        body = text if self.image_token in text else self.image_token + text
        return body if not self.eos or body.endswith(self.eos) else body + self.eos

    def encode(self, pair: Pair) -> dict[str, torch.Tensor]:
        """One sample through the processor, unpadded; longer than ``--seq`` is an error naming it."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(pair.image) as img:
                img.load()
                image = img.convert("RGB")
        except (OSError, UnidentifiedImageError) as e:
            raise DataError(f"train: --data {pair.where}: image {str(pair.image)!r} cannot be read ({e})") from None
        out = self.processor(images=[image], text=[self.prompt(pair.text)], return_tensors="pt")
        sample = {k: v for k, v in out.items() if k != "labels"}
        length = sample["input_ids"].shape[1]
        if length > self.seq:
            raise DataError(f"train: --data {pair.where}: {length} tokens with the image's, --seq {self.seq}; give "
                            f"--seq {length} or more (or a shorter text / a smaller image)")
        return sample

    def next(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        picked = self.indices(self.position)
        self.position += 1
        batch = collate([self.encode(self.pairs[picked[r]]) for r in self.rows], self.seq, self.pad_id)
        inputs = batch.pop("input_ids")
        targets = targets_of(inputs, batch["attention_mask"], self.ignore)
        return inputs, targets, batch

    def state(self) -> dict:
        return {"position": self.position}

    def restore(self, state: dict) -> None:
        self.position = int(state["position"])


class GlobalTokenMeanLoss:
    """Cross entropy as the mean over the global batch's counted tokens (module doc): each step
    sets ``scale`` to ``shards x micro-batches / global count`` before the forward."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return total * self.scale

    def set_for(self, targets: torch.Tensor, meshes, microbatches: int) -> int:
        """Sum this rank's counted targets over ``meshes`` (the ones that split the batch) and set
        the scale; returns the global count."""
        count = (targets != IGNORE).sum().to(torch.float64)   # on the targets' device: nccl reduces device tensors
        shards = 1
        for mesh in meshes:
            dist.all_reduce(count, group=mesh.get_group())
            shards *= mesh.size()
        total = int(count)
        if total == 0:
            raise DataError("train: a global batch of image-text data has no text token to predict (every target is "
                            "padding or an image placeholder); the texts must not be empty")
        self.scale = shards * microbatches / total
        return total


def batch_meshes(runner) -> list:
    """The meshes whose ranks hold different rows of a batch: dp, then ep when it splits the batch
    (without cp, which image-text data refuses, dp is the batch's split; the Trainer's reported
    loss averages over the same two)."""
    meshes = [getattr(runner, "dp_mesh", None), getattr(runner, "ep_mesh", None)]
    return [m for m in meshes if m is not None and m.size() > 1]


def check_plan(plan) -> None:
    """Plans image-text data trains: one stage, no context parallel. A pipeline's stages and a cp
    rank's sequence chunks would each need their own share of the image inputs, which the step
    does not split (typed refusal, before the model is built)."""
    shape = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    if plan.pipeline and int(plan.pipeline.get("pp", 1)) > 1:
        raise TrainConfigError(f"train: image-text data with a pipelined plan (pp={plan.pipeline['pp']}) is not "
                               "supported yet; valid: plans of one stage (dp, tp, FSDP, ep), e.g. --constraints "
                               "dp=2,tp=2,pp=1")
    if shape.get("cp", 1) > 1:
        raise TrainConfigError(f"train: image-text data with context parallelism (cp={shape['cp']}) is not "
                               "supported: the image tokens of a sequence cannot be split; valid: plans without cp")


@dataclass(frozen=True)
class ImageTextSource:
    """What an image-text run reads from, checked before the model is parallelized: the pairs,
    the processor, and the placeholder ids whose targets are ignored."""
    pairs: list
    processor: Any
    ignore: frozenset


def open_image_text(cfg, model) -> ImageTextSource:
    """Check ``model`` (built on meta) is a vision-language model, read the set, load the processor:
    each failure a DataError before any weight is loaded."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        raise DataError(f"train: --data {cfg.data!r} is image-text, but --model {cfg.model!r} has no vision tower "
                        f"({type(model).__name__}); give a vision-language checkpoint, or --data-format tokens")
    pairs = read_pairs(cfg.data)
    processor = load_processor(cfg)
    return ImageTextSource(pairs, processor, frozenset(placeholder_ids(processor, model.config)))


def image_batches(source: ImageTextSource, cfg, runner) -> ImageTextBatches:
    """The Trainer's data: this rank's rows of a global batch, taken from the runner's own split
    (``local_batch`` of the row numbers), so they are the rows the token path would give it."""
    index = torch.arange(cfg.batch).view(cfg.batch, 1)
    rows, _ = runner.local_batch(index, index)
    data = ImageTextBatches(source.pairs, source.processor, batch=cfg.batch, seq=cfg.seq,
                            rows=rows.view(-1).tolist(), ignore=set(source.ignore), source=cfg.data)
    log.info("data: %d image-text pairs from %s, processed by %s", len(source.pairs), cfg.data,
             type(source.processor).__name__)
    return data
