"""Dense message passing over packs: every pack is one [M, M] block of atom pairs.

A batch of B packs of M atoms is viewed as [B, M, ...]. Because molecules never cross packs,
the adjacency matrix of the batch is block diagonal with B blocks of M x M, so SchNet's
messages can be computed on those blocks with elementwise ops and one batched contraction,
without gathers or scatters ("dense hardware" layout):

* :func:`dense_graph`: pairwise distances [B, M, M] and the mask [B, M, M] of the pairs that
  interact: same molecule, both atoms real, i != j, within the cutoff (radius graphs), and
  for knn graphs only the k nearest of those per receiver (a top-k threshold).
* :func:`dense_conv`: ``out[b, i] = sum_j filt[b, i, j] * x[b, j]``, the CFConv sum.

The filters [B, M, M, F] are computed on every pair of the block, masked ones included (their
cosine cutoff is zero), so the pair efficiency is ``real pairs / (B M^2)`` (see
:func:`pair_efficiency`). Only ops both op flavours run: arithmetic, comparisons, ``where``,
``topk`` (knn only, no gradient), ``sqrt`` and ``einsum``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from schnet_ipu.batch import Batch


def dense_graph(
    batch: Batch, nodes_per_pack: int, cutoff: float, k: int | None = None
) -> tuple[Tensor, Tensor]:
    """Distances [B, M, M] and interaction mask [B, M, M] of the packs of ``batch``.

    Entry ``[b, i, j]`` is the pair (receiver i, source j) of pack b. Masked entries read
    ``cutoff`` (their square root is taken after masking, so no NaN gradient at i == j).
    ``k``: keep only the k nearest sources within the cutoff per receiver (knn graphs); as
    the sparse knn search, ties at the k-th distance are not broken (they are measure-zero
    for real coordinates). The distances are differentiable with respect to ``batch.pos``.
    """
    num_nodes = batch.num_nodes
    if num_nodes % nodes_per_pack:
        raise ValueError(f"{num_nodes} atoms are not a whole number of packs of {nodes_per_pack}")
    num_packs = num_nodes // nodes_per_pack
    pos = batch.pos.view(num_packs, nodes_per_pack, 3)
    graph = batch.graph.view(num_packs, nodes_per_pack)
    real = batch.node_mask.view(num_packs, nodes_per_pack)
    x, y, z = pos.unbind(-1)  # summed x, y, z in order, as the loader's cutoff test
    sq = (x.unsqueeze(2) - x.unsqueeze(1)).square()
    sq = sq + (y.unsqueeze(2) - y.unsqueeze(1)).square()
    sq = sq + (z.unsqueeze(2) - z.unsqueeze(1)).square()  # [B, M, M]
    with torch.no_grad():
        local = torch.arange(nodes_per_pack, device=pos.device)
        eye = local.unsqueeze(1) == local.unsqueeze(0)  # a comparison, not torch.eye (PopTorch)
        mask = (graph.unsqueeze(2) == graph.unsqueeze(1)) & real.unsqueeze(2) & real.unsqueeze(1)
        mask = mask & ~eye & (sq <= cutoff * cutoff)
        if k is not None and k < nodes_per_pack - 1:
            candidates = torch.where(mask, sq, torch.full_like(sq, float("inf")))
            kth = candidates.topk(k, dim=2, largest=False).values[..., -1:]  # [B, M, 1]
            mask = mask & (sq <= kth)
    dist = torch.where(mask, sq, sq.new_tensor(cutoff * cutoff)).sqrt()
    return dist, mask


def dense_conv(x: Tensor, filt: Tensor) -> Tensor:
    """``out[b, i] = sum_j filt[b, i, j] * x[b, j]``: x [N, F] (N = B M), filt [B, M, M, F]
    (zero on masked pairs) -> [N, F]."""
    num_packs, nodes_per_pack = filt.shape[:2]
    packed = x.view(num_packs, nodes_per_pack, -1)
    return torch.einsum("bijf,bjf->bif", filt, packed).reshape(x.shape)


def pair_efficiency(mask: Tensor) -> float:
    """Interacting pairs / computed pairs of a dense mask [B, M, M]."""
    return float(mask.sum()) / mask.numel()
