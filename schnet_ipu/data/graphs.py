"""Neighbour graphs in plain vectorised torch (no torch-cluster), never across molecules.

Conventions: a pair is within the cutoff when its distance is <= cutoff; an edge
``(edge_index[0, e], edge_index[1, e]) = (j, i)`` carries a message from source j to target i.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def _as_batch(pos: Tensor, batch: Tensor | None) -> Tensor:
    if batch is None:
        return torch.zeros(pos.shape[0], dtype=torch.long, device=pos.device)
    return batch.to(torch.long)


def _same_molecule_pairs(batch: Tensor) -> tuple[Tensor, Tensor]:
    """All ordered pairs (a, b), self pairs included, of atoms in the same molecule.

    ``batch`` [n] molecule of each atom (any order). Returns two int64 tensors [sum n_g^2].
    """
    order = torch.argsort(batch, stable=True)
    sorted_batch = batch[order]
    counts = torch.bincount(sorted_batch)
    starts = torch.cumsum(counts, 0) - counts
    per_atom = counts[sorted_batch]  # partners of each atom, itself included
    src = torch.repeat_interleave(torch.arange(len(batch), device=batch.device), per_atom)
    block_start = torch.cumsum(per_atom, 0) - per_atom
    local = torch.arange(len(src), device=batch.device) - torch.repeat_interleave(
        block_start, per_atom
    )
    dst = starts[sorted_batch][src] + local
    return order[src], order[dst]


def radius_edges(pos: Tensor, cutoff: float, batch: Tensor | None = None) -> Tensor:
    """All ordered pairs i != j of one molecule within ``cutoff``.

    ``pos`` [n, 3] Angstrom, ``batch`` [n] molecule ids (None: one molecule).
    Returns int64 edge_index [2, E] (both directions of every pair).
    """
    a, b = _same_molecule_pairs(_as_batch(pos, batch))
    keep = (a != b) & ((pos[a] - pos[b]).norm(dim=-1) <= cutoff)
    return torch.stack([b[keep], a[keep]])


def knn_edges(pos: Tensor, k: int, cutoff: float, batch: Tensor | None = None) -> Tensor:
    """The (at most) k nearest other atoms of the same molecule within ``cutoff``, per atom.

    ``pos`` [n, 3], ``batch`` [n]. Returns edge_index [2, E]: row 0 the neighbour (source),
    row 1 the centre atom (target); E <= k * n.
    """
    a, b = _same_molecule_pairs(_as_batch(pos, batch))
    keep = a != b
    a, b = a[keep], b[keep]
    dist = (pos[a] - pos[b]).norm(dim=-1)
    # Sort candidates by (centre, distance) and keep the first k of each centre.
    order = torch.argsort(dist, stable=True)
    order = order[torch.argsort(a[order], stable=True)]
    a, b, dist = a[order], b[order], dist[order]
    counts = torch.bincount(a, minlength=pos.shape[0])
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(a), device=pos.device) - first[a]
    keep = (rank < k) & (dist <= cutoff)
    return torch.stack([b[keep], a[keep]])


def molecule_pairs(pos: Tensor | np.ndarray, cutoff: float) -> tuple[Tensor, Tensor]:
    """Unordered pairs of one molecule within ``cutoff``: int64 (i [P], j [P]) with i < j,
    row-major; by :func:`within_cutoff`, so they are the pairs the loader finds."""
    pos = torch.as_tensor(pos)
    return within_cutoff(pos.unsqueeze(0), cutoff)[0].triu_(1).nonzero(as_tuple=True)


def within_cutoff(block: Tensor, cutoff: float) -> Tensor:
    """bool [B, n, n]: atoms a, b of block [B, n, 3] are within ``cutoff`` (a == b included).

    The one distance test behind the pairs file (:mod:`.pairs`), hence behind both the
    packer's edge counts and the loader's radius graphs. Squared distances are summed
    x, y, z in that order by elementwise ops, so a pair gets the same bits in any block;
    :func:`pairs_within_cutoff` evaluates the same arithmetic on chosen pairs only.
    """
    x, y, z = block.unbind(-1)
    square = (x.unsqueeze(2) - x.unsqueeze(1)).square_()
    square += (y.unsqueeze(2) - y.unsqueeze(1)).square_()
    square += (z.unsqueeze(2) - z.unsqueeze(1)).square_()
    return square <= cutoff * cutoff


def pairs_within_cutoff(
    x: Tensor, y: Tensor, z: Tensor, i: Tensor, j: Tensor, cutoff: float
) -> Tensor:
    """bool [B, P]: atoms i[p], j[p] of each of B molecules are within ``cutoff``.

    ``x``, ``y``, ``z`` [B, n] coordinates; ``i``, ``j`` int64 [P] local atoms. Bit for bit
    :func:`within_cutoff`'s test of those pairs (same differences, same x, y, z order), at
    the cost of P pairs instead of n * n.
    """
    square = (x.index_select(1, i) - x.index_select(1, j)).square_()
    square += (y.index_select(1, i) - y.index_select(1, j)).square_()
    square += (z.index_select(1, i) - z.index_select(1, j)).square_()
    return square <= cutoff * cutoff
