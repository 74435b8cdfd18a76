"""Batches of molecules held in memory, for tests: random QM9 molecules from a store, packs
from the packing library, and the loader's collate (moved here from schnet_ipu.bench.model)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.batch_layout import Layout
from schnet_ipu.collate import PackMolecule, collate
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.packing import assign_packs, plan_packing

Molecule = "tuple[np.ndarray, np.ndarray]"  # z [n] (int), pos [n, 3] (A); string: Python 3.8


def molecules_to_batch(
    molecules: Sequence[Molecule],
    packs: Sequence[Sequence[int]],
    max_nodes: int,
    max_graphs: int,
    max_edges: int | None = None,
    cutoff: float = 6.0,
    targets: Sequence[float] | None = None,
) -> Batch:
    """Collate ``packs`` (lists of indices into ``molecules``) with the loader's collate;
    radius edges (within ``cutoff``) when ``max_edges`` is given. For tests and benchmarks
    on molecules held in memory."""
    layout = Layout(
        len(packs), max_nodes, max_graphs, max_edges, None if max_edges is None else cutoff
    )
    chosen = [
        [
            PackMolecule(
                np.asarray(molecules[m][0]),
                np.asarray(molecules[m][1], dtype=np.float32),
                0.0 if targets is None else float(targets[m]),
                int(m),
            )
            for m in pack
        ]
        for pack in packs
    ]
    return collate(chosen, layout)


def pair_array(pos: np.ndarray, cutoff: float) -> np.ndarray:
    """Unordered pairs (i < j) of one molecule within ``cutoff`` -> int64 [P, 2]."""
    i, j = molecule_pairs(torch.as_tensor(np.asarray(pos, dtype=np.float32)), cutoff)
    return torch.stack([i, j], dim=1).numpy()


def plan_packs(
    sizes: Sequence[int],
    max_nodes: int,
    max_graphs: int,
    edges: Sequence[int] | None = None,
    max_edges: int = 0,
) -> list[np.ndarray]:
    """Packs of molecule indices from the packing library: LPFHP over atoms, or tuple
    packing over (atoms, directed ``edges``) when edges are given."""
    nodes = np.asarray(sizes)
    edge_counts = None if edges is None else np.asarray(edges)
    plan = plan_packing(
        nodes,
        edge_counts,
        algorithm="lpfhp" if edges is None else "tuple",
        max_nodes=max_nodes,
        max_edges=max_edges,
        max_graphs=max_graphs,
    )
    return assign_packs(plan, nodes, edge_counts, seed=0, epoch=0)


def load_molecules(store: str, count: int, seed: int) -> list[Molecule]:
    """``count`` distinct molecules drawn at random (``seed``) from a MoleculeStore."""
    from schnet_ipu.data import MoleculeStore

    molecules = MoleculeStore(store)
    chosen = np.random.default_rng(seed).choice(len(molecules), count, replace=False)
    return [molecules.molecule(int(i)) for i in np.sort(chosen)]
