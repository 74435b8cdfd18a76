"""Helpers the loader tests share: an epoch's batches, and equality of batch lists."""

from __future__ import annotations

import torch

from schnet_ipu.batch import Batch
from schnet_ipu.loader import PackedLoader


def epoch_batches(loader: PackedLoader, epoch: int) -> list[Batch]:
    return [b for call in loader.epoch(epoch) for b in call]


def assert_same_batches(xs, ys) -> None:
    """Equal fields, shapes, dtypes and values, batch by batch."""
    xs, ys = list(xs), list(ys)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.present_fields() == y.present_fields() and x.signature() == y.signature()
        for t, u in zip(x.as_tuple(), y.as_tuple(), strict=True):
            assert torch.equal(t, u)
