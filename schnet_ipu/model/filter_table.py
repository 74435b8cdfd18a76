"""The tabulated filter (``model.filter: table``): a block's filter network on a grid, read by
cubic Hermite interpolation.

A SchNet filter ``W(d) = lin2(ssp(lin1(rbf(d)))) * cut(d)`` depends on one scalar, the edge
length d. With ``filter="table"`` the model evaluates every block's network once per
forward pass (all blocks in one batched product) on K distances ``d_k = k h``,
``h = cutoff / (K - 1)``, k = 0..K-1, together with its exact derivative ``dW/dd``
(forward mode, written out: ``rbf' = rbf * 2c (d - mu)``, ``ssp' = sigmoid``,
``cut' = -pi / (2 cutoff) sin(pi d / cutoff)``), and every edge reads its filter by cubic
Hermite interpolation of those values and slopes:

    s = d / h,  k = clamp(floor(s), 0, K - 2),  t = s - k,
    W = (2t^3 - 3t^2 + 1) v_k + (t^3 - 2t^2 + t) h s_k
        + (-2t^3 + 3t^2) v_{k+1} + (t^3 - t^2) h s_{k+1}

The interpolant is continuous with a continuous first derivative in d (it matches value and
slope at every grid point), so forces and molecular dynamics see a C^1 potential. Its error
is bounded by ``h^4 / 384 max|W''''|`` for W and ``sqrt(3) / 216 h^3 max|W''''|`` for
``dW/dd`` (de Boor, *A Practical Guide to Splines*, ch. IV: cubic Hermite error); on the
paper's filter network (25 Gaussians, 6 Angstrom) that is ~4e-7 relative for W and ~2e-5
for its slope at K = 256, below float32's resolution for W at K >= 256.

Each table is built from its block's own parameters inside the autograd graph, so parameter
gradients reach ``lin1``/``lin2`` of the filter network through the values and the slopes:
training is exact for the interpolated model, and parameters and names are those of the
exact model (a state dict moves freely between ``filter="exact"`` and ``"table"``).

Per interval the Hermite form is a cubic in t; :func:`hermite_coefficients` gives its four
coefficients [K - 1, 4, F] (``W = c0 + c1 t + c2 t^2 + c3 t^3``), which is what the op
flavours' ``table_conv`` reads: one row gather per edge instead of four.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.nn import Sequential


def grid_spacing(cutoff: float, num_points: int) -> float:
    """h = cutoff / (K - 1), the distance between grid points."""
    return cutoff / (num_points - 1)


class Expansion(Protocol):
    """The model's Gaussian expansion: ``rbf(d) = exp(coeff (d - offset)^2)``, the exponent
    floored as the module does it (``GaussianSmearing``)."""

    offset: Tensor  # the Gaussian centres [G]
    coeff: float

    def __call__(self, dist: Tensor) -> Tensor:
        """dist [K] -> rbf [K, G]."""
        ...


def filter_tables(
    mlps: Sequence[Sequential], expansion: Expansion, cutoff: float, num_points: int
) -> tuple[Tensor, Tensor]:
    """Values ``W_b(d_k)`` [B, K, F] and slopes ``dW_b/dd(d_k)`` [B, K, F] of the filters of
    B blocks at once.

    Args:
        mlps: the B blocks' filter networks, each ``Sequential(Linear(G, F), act,
            Linear(F, F))`` whose activation is a shifted softplus (its derivative is the
            sigmoid).
        expansion: the model's Gaussian expansion.
        cutoff: the cosine cutoff radius, folded into the table.
        num_points: K >= 2 grid points on [0, cutoff].

    The B networks run as one batched product per layer on their stacked weights: a table
    is small (K = 256 rows), so per-op cost dominates and one op for all blocks is about
    1.4x faster than one per block (3 blocks, forward and backward, CPU: 3.3 against
    4.5 ms with denormals flushed in both). Differentiable
    in the networks' parameters (the slopes too: their gradient is part of the interpolated
    model's gradient).
    """
    offset = expansion.offset
    dist = torch.arange(num_points, device=offset.device, dtype=offset.dtype)
    dist = dist * grid_spacing(cutoff, num_points)  # [K]
    rbf = expansion(dist)  # [K, G]
    rbf_slope = rbf * (2.0 * expansion.coeff) * (dist.unsqueeze(-1) - offset)
    weight1 = torch.stack([mlp[0].weight for mlp in mlps]).transpose(1, 2)  # [B, G, F]
    bias1 = torch.stack([mlp[0].bias for mlp in mlps]).unsqueeze(1)  # [B, 1, F]
    weight2 = torch.stack([mlp[2].weight for mlp in mlps]).transpose(1, 2)  # [B, F, F]
    bias2 = torch.stack([mlp[2].bias for mlp in mlps]).unsqueeze(1)
    pre = torch.matmul(rbf, weight1) + bias1  # [B, K, F]
    pre_slope = torch.matmul(rbf_slope, weight1)
    hidden = mlps[0][1](pre)
    hidden_slope = torch.sigmoid(pre) * pre_slope
    out = torch.matmul(hidden, weight2) + bias2
    out_slope = torch.matmul(hidden_slope, weight2)
    angle = dist * (math.pi / cutoff)
    cut = (0.5 * (torch.cos(angle) + 1.0)).unsqueeze(-1)  # [K, 1]
    cut_slope = (-0.5 * math.pi / cutoff * torch.sin(angle)).unsqueeze(-1)
    values = out * cut
    slopes = out_slope * cut + out * cut_slope
    return values, slopes


def hermite_coefficients(values: Tensor, slopes: Tensor, cutoff: float) -> Tensor:
    """Cubic coefficients [K - 1, 4, F] per grid interval: ``W = c0 + c1 t + c2 t^2 + c3 t^3``
    on [d_k, d_{k+1}] with t in [0, 1] (the Hermite basis above, expanded in powers of t)."""
    h = grid_spacing(cutoff, values.shape[0])
    v0, v1 = values[:-1], values[1:]
    m0, m1 = slopes[:-1] * h, slopes[1:] * h
    c2 = 3.0 * (v1 - v0) - 2.0 * m0 - m1
    c3 = 2.0 * (v0 - v1) + m0 + m1
    return torch.stack([v0, m0, c2, c3], dim=1)


def grid_position(dist: Tensor, num_points: int, cutoff: float) -> tuple[Tensor, Tensor]:
    """Interval index k [E] (int64) and position t [E] in it (differentiable in ``dist``):
    ``s = d / h``, ``k = clamp(floor(s), 0, K - 2)``, ``t = s - k``."""
    s = dist / grid_spacing(cutoff, num_points)
    k = torch.clamp(torch.floor(s.detach()), 0.0, float(num_points - 2))
    return k.long(), s - k


def hermite_filter(
    dist: Tensor, edge_mask: Tensor, values: Tensor, slopes: Tensor, cutoff: float
) -> Tensor:
    """The interpolated filter [E, F] of edges of length ``dist`` [E] (0 where ``edge_mask``
    [E] is False), in plain torch ops: the reference the fused loops are tested against."""
    index, t = grid_position(dist, values.shape[0], cutoff)
    coeffs = hermite_coefficients(values, slopes, cutoff).index_select(0, index)  # [E, 4, F]
    t = t.to(coeffs.dtype).unsqueeze(-1)
    filt = ((coeffs[:, 3] * t + coeffs[:, 2]) * t + coeffs[:, 1]) * t + coeffs[:, 0]
    return torch.where(edge_mask.unsqueeze(-1), filt, 0.0)
