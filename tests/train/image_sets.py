"""Tiny vision-language checkpoints with their processors, and small image-text sets, built offline.

What a user brings to ``autoplan train`` with images: a ``save_pretrained`` directory holding the
model *and* its processor (``processor.save_pretrained(dir)``), and a folder of images with their
texts. Nothing here is downloaded: the tokenizer is a byte-pair model trained on the captions,
the image processors are made from their classes' arguments (the PIL ones: torchvision is not
installed), the weights are random.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
            "<|vision_end|>"]
WORDS = ("a red square on a blue field", "two green dots", "the sky at noon", "a small yellow cat",
         "stripes of black and white", "an empty grey room", "one orange circle", "waves under a purple moon")


def caption(i: int) -> str:
    """The text of pair ``i``: a few captions of different lengths, so rows pad differently."""
    return " ".join(WORDS[j % len(WORDS)] for j in range(i, i + 1 + i % 3))


def tokenizer():
    """A fast tokenizer trained here on the captions (vocabulary < 160), with the image tokens of
    both processor styles as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([caption(i) for i in range(16)] * 4,
                            trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def _text(tok) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=160, max_position_embeddings=256,
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def llava_checkpoint(path: Path, seed: int = 0) -> Path:
    """A LLaVA (CLIP tower at 28 px / patch 14: 4 image tokens per image) and its processor."""
    import transformers

    tok = tokenizer()
    image_id = tok.convert_tokens_to_ids("<image>")
    config = transformers.LlavaConfig(
        text_config=dict(model_type="llama", **_text(tok)), image_token_index=image_id,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=14, projection_dim=32),
        vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, num_additional_image_tokens=1,
                                vision_feature_select_strategy="default").save_pretrained(path)
    return path


def image_only_qwen2_vl_processor():
    """Qwen2-VL's processor without its video half, registered with AutoProcessor for Qwen2-VL.

    transformers builds Qwen2-VL's processor only with its video processor, which needs
    torchvision, and torchvision is not installed here: ``AutoProcessor`` cannot load a real
    Qwen2-VL directory in this environment. Registering a processor class is transformers' own
    way of supplying one; this one has the image processor and the tokenizer, and turns images
    into patches and image tokens exactly as Qwen2-VL's does."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(transformers.Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    found = transformers.models.auto.processing_auto.PROCESSOR_MAPPING._extra_content.get(transformers.Qwen2VLConfig)
    if found is not None:
        return found
    transformers.AutoProcessor.register(transformers.Qwen2VLConfig, ImageOnlyQwen2VLProcessor, exist_ok=True)
    return ImageOnlyQwen2VLProcessor


def qwen2_vl_checkpoint(path: Path, seed: int = 0) -> Path:
    """A Qwen2-VL (patch 14, 2x2 merge: a 28x28 image is 4 patches and 1 token, 56x28 is 8 and 2)
    and its processor."""
    import transformers

    tok = tokenizer()
    text = dict(model_type="qwen2_vl_text", rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, **_text(tok))
    config = transformers.Qwen2VLConfig(
        text_config=text, image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        vision_config=dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=64, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=56))
    torch.manual_seed(seed)
    transformers.Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                                temporal_patch_size=2)
    image_only_qwen2_vl_processor()(image_processor=images, tokenizer=tok).save_pretrained(path)
    return path


def image(i: int, size: tuple[int, int] = (28, 28)):
    """A deterministic RGB image (width, height): a colour gradient that depends on ``i``."""
    from PIL import Image

    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 9 + i * 40) % 256, (y * 7 + i * 23) % 256, ((x + y) * 5 + i * 61) % 256], -1)
    return Image.fromarray(rgb.astype(np.uint8))


def jsonl_set(folder: Path, n: int = 16, sizes=((28, 28),)) -> Path:
    """``n`` pairs as ``data.jsonl`` (image paths relative to it, in ``images/``); image ``i`` has
    size ``sizes[i % len(sizes)]``."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        image(i, sizes[i % len(sizes)]).save(folder / "images" / f"{i:02d}.png")
        lines.append(json.dumps({"image": f"images/{i:02d}.png", "text": caption(i)}))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "data.jsonl"


def folder_set(folder: Path, n: int = 16, sizes=((28, 28),)) -> Path:
    """``n`` pairs as a folder of ``NN.png`` + ``NN.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        image(i, sizes[i % len(sizes)]).save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(caption(i) + "\n")
    return folder


def sharding_plan(checkpoint: Path, out: Path, width: int = 16) -> Path:
    """A dp=2 x tp=2 plan for ``checkpoint`` that shards its decoder and its vision tower.

    At the test's widths the planner rightly keeps every unit replicated (tensor parallelism
    costs more than it saves) and refuses to shard all of Qwen2-VL (its patch merger is planned by
    no unit), so the plan is made for the same architecture ``width`` times wider -- where the
    planner chooses tensor parallelism itself -- and applied to the small model (the styles
    name modules, which the two share)."""
    from autoplan import MeshSpec, autoplan
    from autoplan.train.model import build_model

    cfg = json.loads((checkpoint / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    for key in ("hidden_size", "intermediate_size"):
        text[key] *= width
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    for key in ("rope_scaling", "rope_parameters"):   # M-RoPE's sections span half the head dim
        if isinstance(text.get(key), dict) and "mrope_section" in text[key]:
            text[key]["mrope_section"] = [x * width for x in text[key]["mrope_section"]]
    for key in ("embed_dim", "hidden_size", "intermediate_size", "projection_dim"):
        if key in vision:
            vision[key] *= width
    wide = out.with_suffix(".wide.json")
    wide.write_text(json.dumps(cfg))
    plan = autoplan(build_model(str(wide), device="meta"), MeshSpec((2, 2), ("dp", "tp")), batch=(4, 512),
                    hardware="h100_sxm", dtype=torch.float32)
    plan.replace(model=dict(plan.model, source=str(checkpoint))).to_json(out)
    return out
