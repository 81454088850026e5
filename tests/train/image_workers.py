"""Run on every rank of a RankPool (and in the test process for one device) by tests/train/test_images.py."""
from __future__ import annotations

from tests.train import image_sets, train_workers


def cli(argv: list[str]) -> dict:
    """``autoplan train`` on this rank (train_workers.cli), with the image-only Qwen2-VL processor
    registered first (image_sets.image_only_qwen2_vl_processor: why it is needed here)."""
    image_sets.image_only_qwen2_vl_processor()
    return train_workers.cli(argv)
