"""Forward+backward speed of our SchNet against PyG's stock SchNet on identical molecules.

    python -m schnet_ipu.model.benchmark [--molecules 512] [--repeats 5] [--store data/qm9.h5]

Both models get the same weights, the same molecules and the same interaction graph. PyG's
default radius graph needs torch-cluster, which is not installed, so PyG is given an
``interaction_graph`` callable in pure torch that returns the real edges of our graph
(precomputed outside the timed region) and their lengths from ``pos`` (inside it). Our knn
search runs inside the timed forward pass, so the comparison favours PyG.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch

Molecule = tuple[np.ndarray, np.ndarray]  # z [n] (int), pos [n, 3] (Angstrom)

PAD_SPACING = 1000.0  # padding atoms sit this far apart, and this far from the origin


def radius_pairs(pos: np.ndarray, cutoff: float) -> np.ndarray:
    """Unordered pairs (i < j) of one molecule closer than ``cutoff`` -> [2, P] int64."""
    dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
    i, j = np.nonzero(np.triu(dist <= cutoff, k=1))
    return np.stack([i, j]).astype(np.int64)


def molecules_to_batch(
    molecules: Sequence[Molecule],
    packs: Sequence[Sequence[int]],
    max_nodes: int,
    max_graphs: int,
    max_edges: int | None = None,
    cutoff: float = 6.0,
    targets: Sequence[float] | None = None,
) -> Batch:
    """Collate ``packs`` (lists of indices into ``molecules``) into one Batch following the
    contract of :mod:`schnet_ipu.batch`; radius edges (within ``cutoff``) when ``max_edges``.

    A minimal stand-in for the loader, for tests and the benchmark.
    """
    num_packs = len(packs)
    n, g = num_packs * max_nodes, num_packs * max_graphs
    z = torch.zeros(n, dtype=torch.int64)
    pad = torch.arange(n, dtype=torch.float32) * PAD_SPACING + PAD_SPACING
    pos = torch.stack([pad, torch.zeros(n), torch.zeros(n)], dim=1)
    graph = torch.full((n,), g, dtype=torch.int64)
    node_mask = torch.zeros(n, dtype=torch.bool)
    y = torch.zeros(g)
    graph_mask = torch.zeros(g, dtype=torch.bool)
    molecule_index = torch.full((g,), -1, dtype=torch.int64)
    pairs: list[Tensor] = []
    for p, members in enumerate(packs):
        if len(members) > max_graphs:
            raise ValueError(f"pack {p} holds {len(members)} molecules > max_graphs={max_graphs}")
        atom = p * max_nodes
        for slot, m in enumerate(members, start=p * max_graphs):
            mz, mpos = molecules[m]
            count = len(mz)
            if atom + count > (p + 1) * max_nodes:
                raise ValueError(f"pack {p} overflows max_nodes={max_nodes}")
            z[atom : atom + count] = torch.as_tensor(np.asarray(mz, dtype=np.int64))
            pos[atom : atom + count] = torch.as_tensor(np.asarray(mpos, dtype=np.float32))
            graph[atom : atom + count] = slot
            node_mask[atom : atom + count] = True
            graph_mask[slot] = True
            molecule_index[slot] = m
            y[slot] = 0.0 if targets is None else float(targets[m])
            if max_edges is not None:
                pairs.append(torch.as_tensor(radius_pairs(np.asarray(mpos), cutoff)) + atom)
            atom += count
        if max_edges is not None:
            pack_pairs = sum(x.shape[1] for x in pairs[len(pairs) - len(members) :])
            if 2 * pack_pairs > max_edges:
                raise ValueError(f"pack {p} needs {2 * pack_pairs} edges > max_edges={max_edges}")
    edge_index = edge_mask = None
    if max_edges is not None:
        real = torch.cat(pairs, dim=1) if pairs else torch.zeros(2, 0, dtype=torch.int64)
        half = num_packs * max_edges // 2
        filler = int(torch.nonzero(~node_mask)[0]) if (~node_mask).any() else 0
        forward = torch.full((2, half), filler, dtype=torch.int64)
        forward[:, : real.shape[1]] = real
        edge_index = torch.cat([forward, forward.flip(0)], dim=1)
        mask = torch.zeros(half, dtype=torch.bool)
        mask[: real.shape[1]] = True
        edge_mask = torch.cat([mask, mask])
    return Batch(z, pos, graph, node_mask, y, graph_mask, molecule_index, edge_index, edge_mask)


def greedy_packs(sizes: Sequence[int], max_nodes: int, max_graphs: int) -> list[list[int]]:
    """First fit: each molecule, in order, joins the first pack with room (no optimisation)."""
    packs: list[list[int]] = []
    used: list[int] = []
    for i, size in enumerate(sizes):
        if size > max_nodes:
            raise ValueError(f"molecule {i} has {size} atoms > max_nodes={max_nodes}")
        for p, members in enumerate(packs):
            if used[p] + size <= max_nodes and len(members) < max_graphs:
                members.append(i)
                used[p] += size
                break
        else:
            packs.append([i])
            used.append(size)
    return packs
