"""Ops shared by every flavour: they use only what both torch and PopTorch run as written."""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2 = math.log(2.0)


def naive_shifted_softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x)) - log 2`` as written, which overflows to ``inf`` for large ``x``
    (``x > 88`` in float32). Only for the ``stable_softplus=False`` ablation.
    """
    return torch.log(1.0 + torch.exp(x)) - LOG2


def edge_distance(pos: Tensor, edge_index: Tensor, edge_mask: Tensor, cutoff: float) -> Tensor:
    """Length [E] of each edge in ``edge_index`` [2, E] over ``pos`` [N, 3]; masked edges read
    ``cutoff``.

    The square root is taken after masking, so masked (zero-length) edges give no NaN gradient.
    """
    diff = pos.index_select(0, edge_index[0]) - pos.index_select(0, edge_index[1])
    sq = diff.square().sum(-1)
    return torch.where(edge_mask, sq, cutoff * cutoff).sqrt()  # a scalar: no host copy
