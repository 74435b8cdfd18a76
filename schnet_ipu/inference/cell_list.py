"""Neighbour pairs of one structure in torch ops: the linked-cell search the exported model
runs itself (TorchScript; a libtorch, LAMMPS or i-PI user has no vesin).

    i, j, shift = neighbour_pairs(pos, cell, pbc, cutoff)   # half list, O(N)
    i, j = knn_pairs(pos, cutoff, k)                         # a knn model's (molecules)

A pair (i, j, S) says that atom j's image ``pos[j] + S @ cell`` lies within ``cutoff`` of
atom i (ASE's ``neighbor_list("ijS")`` convention, as :mod:`schnet_ipu.data.periodic_pairs`):
each unordered pair once, with i < j, or i == j and S lexicographically positive (an atom
and its own image, in cells smaller than the cutoff); never an atom with itself. Any of the
8 pbc combinations, triclinic cells, and cells thinner than the cutoff.

How: along periodic directions the atoms are wrapped into the cell and copied to every
image within ``cutoff`` of it (``ceil(cutoff / plane spacing)`` cells each way, so a thin
cell gets several layers); the atoms and their images are put in Cartesian bins of side
``cutoff`` (sorted bin keys, no dense bin array, so far-apart atoms cost nothing), and each
atom's candidates are the contents of its 27 surrounding bins: O(N) work and memory, about
``27 * density * cutoff^3`` candidates per atom. Small structures (under ``DENSE_PAIRS``
atom-image pairs) take every pair at once instead, which is faster there.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple  # typing's forms: TorchScript on Python 3.8

import torch
from torch import Tensor

DENSE_PAIRS = 65536  # below this many (atom, atom or image) candidates: all pairs at once
CENTRE_BLOCK = 1024  # centres whose candidates are gathered at once (~300 each in a metal)


def lexicographically_positive(shift: Tensor) -> Tensor:
    """[P] True where the integer shift [P, 3] is > 0 in lexicographic order."""
    s0, s1, s2 = shift[:, 0], shift[:, 1], shift[:, 2]
    return (s0 > 0) | ((s0 == 0) & ((s1 > 0) | ((s1 == 0) & (s2 > 0))))


def periodic_images(
    pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The atoms wrapped into the cell along periodic directions, and their images near it.

    pos [N, 3], cell [3, 3] (rows the lattice vectors, non-singular), pbc bool [3] ->
    (wrap [N, 3], points [M, 3], owner [M] int64, shift [M, 3]): atom n wrapped is
    ``pos[n] - wrap[n] @ cell``; point m is atom ``owner[m]`` at ``pos + shift @ cell``
    (wrap and shift integer-valued in pos's dtype, relative to the unwrapped ``pos``).
    """
    periodic = pbc.to(pos.dtype)
    inverse = torch.linalg.inv(cell)
    frac = pos @ inverse  # [N, 3]
    wrap = torch.floor(frac) * periodic  # whole cells each atom is moved by
    frac = frac - wrap
    reach = cutoff * inverse.square().sum(0).sqrt() * periodic  # cutoff / plane spacing, 0 if open
    layers: List[int] = torch.ceil(reach).long().tolist()
    ranges = [torch.arange(-n, n + 1, dtype=pos.dtype, device=pos.device) for n in layers]
    images = torch.cartesian_prod(ranges[0], ranges[1], ranges[2]).view(-1, 3)  # [S, 3]
    image_frac = frac.unsqueeze(0) + images.unsqueeze(1)  # [S, N, 3]
    near = (image_frac >= -reach) & (image_frac <= 1.0 + reach)
    keep = (near | ~pbc).all(-1)  # [S, N]
    image_index, owner = keep.nonzero().unbind(1)
    shift = images.index_select(0, image_index) - wrap.index_select(0, owner)
    points = pos.index_select(0, owner) + shift @ cell
    return wrap, points, owner, shift


def candidate_pairs(
    centres: Tensor,
    points: Tensor,
    cutoff: float,
    dense_pairs: int = DENSE_PAIRS,
    centre_block: int = CENTRE_BLOCK,
) -> Tuple[Tensor, Tensor]:
    """Every (centre c, point p) within ``cutoff`` (c [C], p [C] int64), for centres [N, 3]
    and points [M, 3] (the centres' region covered by the points), by bins of side cutoff,
    or all pairs at once below ``dense_pairs`` candidates; ``centre_block`` centres at a time."""
    n, m = centres.shape[0], points.shape[0]
    if n * m <= dense_pairs:
        square = (centres.unsqueeze(1) - points.unsqueeze(0)).square().sum(-1)  # [N, M]
        c, p = (square <= cutoff * cutoff).nonzero().unbind(1)
        return c, p
    low = points.min(0).values
    point_bin = torch.floor((points - low) / cutoff).long()  # [M, 3]
    dims = point_bin.max(0).values + 1
    key = (point_bin[:, 0] * dims[1] + point_bin[:, 1]) * dims[2] + point_bin[:, 2]
    sorted_key, order = torch.sort(key)
    centre_bin = torch.floor((centres - low) / cutoff).long()
    step = torch.arange(-1, 2, device=centres.device)
    around = torch.cartesian_prod(step, step, step)  # [27, 3]
    found_c: List[Tensor] = []
    found_p: List[Tensor] = []
    for first in range(0, n, centre_block):  # blocks: candidate arrays of a few MB at any N
        block = centre_bin[first : first + centre_block]
        c, p = _block_candidates(block, dims, sorted_key, order, around)
        c = c + first
        square = centres.new_zeros(c.shape[0])
        for axis in range(3):  # 1-D gathers: faster than rows of 3
            square += (
                points[:, axis].index_select(0, p) - centres[:, axis].index_select(0, c)
            ) ** 2
        close = square <= cutoff * cutoff
        found_c.append(c[close])
        found_p.append(p[close])
    return torch.cat(found_c), torch.cat(found_p)


def _block_candidates(
    centre_bin: Tensor, dims: Tensor, sorted_key: Tensor, order: Tensor, around: Tensor
) -> Tuple[Tensor, Tensor]:
    """(centre c [C] in the block, point p [C]): every point in the 27 bins around each
    centre's bin ``centre_bin`` [B, 3] (points by ``sorted_key`` and its ``order``)."""
    near_bin = centre_bin.unsqueeze(1) + around  # [B, 27, 3]
    inside = ((near_bin >= 0) & (near_bin < dims)).all(-1).view(-1)
    near_key = (near_bin[..., 0] * dims[1] + near_bin[..., 1]) * dims[2] + near_bin[..., 2]
    near_key = near_key.view(-1)
    start = torch.searchsorted(sorted_key, near_key)
    count = torch.where(inside, torch.searchsorted(sorted_key, near_key, right=True) - start, 0)
    total = int(count.sum())
    first = torch.cumsum(count, 0) - count
    slot = torch.arange(total, device=centre_bin.device) - torch.repeat_interleave(first, count)
    p = order.index_select(0, torch.repeat_interleave(start, count) + slot)
    per_centre = count.view(-1, 27).sum(1)
    c = torch.repeat_interleave(
        torch.arange(centre_bin.shape[0], device=centre_bin.device), per_centre
    )
    return c, p


def neighbour_pairs(
    pos: Tensor, cell: Optional[Tensor], pbc: Optional[Tensor], cutoff: float
) -> Tuple[Tensor, Tensor, Tensor]:
    """The half list (i [P], j [P] int64, shift [P, 3] integer-valued in pos's dtype) of
    ``pos`` [N, 3] within ``cutoff`` (see the module docstring). ``cell`` [3, 3] and ``pbc``
    bool [3]: periodic along the True directions (pbc None with a cell: all three); no cell
    or no True pbc: a molecule. A partially periodic cell needs all three vectors."""
    pos = pos.detach()
    if cell is None or (pbc is not None and not bool(pbc.any())):
        i, j = candidate_pairs(pos, pos, cutoff)
        keep = i < j
        return i[keep], j[keep], pos.new_zeros((int(keep.sum()), 3))
    if pbc is None:
        pbc = torch.ones(3, dtype=torch.bool, device=pos.device)
    cell = cell.detach().to(pos.dtype)
    if not bool(torch.isfinite(cell).all()):
        raise ValueError("cell must be finite (NaN or inf found)")
    if not float(torch.linalg.det(cell).abs()) >= 1e-9:
        raise ValueError("a periodic cell needs three independent vectors (zero volume given)")
    wrap, points, owner, shift = periodic_images(pos, cell, pbc, cutoff)
    i, m = candidate_pairs(pos - wrap @ cell, points, cutoff)
    # point m - wrapped atom i = pos[j] + (shift + wrap[i]) @ cell - pos[i]
    shift = shift.index_select(0, m) + wrap.index_select(0, i)
    return _half(i, owner.index_select(0, m), shift)


def _half(i: Tensor, j: Tensor, shift: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    keep = (i < j) | ((i == j) & lexicographically_positive(shift))
    return i[keep], j[keep], shift[keep]


def knn_pairs(pos: Tensor, cutoff: float, k: int) -> Tuple[Tensor, Tensor]:
    """(receiver i, source j) [N k'] of a knn graph: the ``k`` nearest atoms within
    ``cutoff`` of every atom of ``pos`` [N, 3], from the [N, N] distance matrix (molecules
    of up to some thousand atoms)."""
    n = pos.shape[0]
    sq = (pos.unsqueeze(1) - pos.unsqueeze(0)).square().sum(-1)  # [N, N], [i, j]
    allowed = (sq <= cutoff * cutoff) & ~torch.eye(n, dtype=torch.bool, device=pos.device)
    found = min(k, n - 1)
    best, source = torch.topk(sq.masked_fill(~allowed, math.inf), found, dim=1, largest=False)
    receiver = torch.arange(n, device=pos.device).unsqueeze(1).expand(n, found)
    real = torch.isfinite(best)
    return receiver[real], source[real]
