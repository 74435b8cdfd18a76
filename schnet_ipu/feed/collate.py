"""The collate: packs of molecules held in memory -> one fixed-shape Batch.

For molecules outside a store (new structures, tests, benchmarks). Their flat arrays
(:class:`~schnet_ipu.feed.arrays.FeedArrays`) are built here with their own neighbour
search (radius pairs by :func:`~schnet_ipu.data.graphs.molecule_pairs`, periodic pairs by
:func:`~schnet_ipu.data.periodic_pairs.frame_pairs`), and the batch by the loader's array
program (:func:`~schnet_ipu.feed.assembly.assemble_batch`): a store's molecules collated here
give the loader's batch bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from schnet_ipu.batch import Batch
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.data.pairs_file import RadiusPairs
from schnet_ipu.data.periodic_pairs import PeriodicPairs, frame_pairs
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.assembly import assemble_batch
from schnet_ipu.feed.layout import Layout, LoaderError


class PackMolecule(NamedTuple):
    """One molecule as the collate needs it."""

    z: np.ndarray  # [n] atomic numbers
    pos: np.ndarray  # [n, 3] float32 positions in Angstrom
    y: float  # target
    index: int  # index in the store (-1 allowed for molecules from elsewhere)
    forces: np.ndarray | None = None  # [n, 3] float32 target forces, optional
    cell: np.ndarray | None = None  # [3, 3] lattice vectors as rows (periodic frames)
    pbc: np.ndarray | None = None  # bool [3] (with cell; None: periodic along all three)


def collate(
    packs: Sequence[Sequence[PackMolecule]], layout: Layout, with_forces: bool | None = None
) -> Batch:
    """Packs of molecules -> one Batch with the shapes of ``layout`` (see schnet_ipu.batch).

    Fewer packs than ``layout.packs_per_batch`` leave the rest empty (all padding). Raises
    LoaderError when a pack holds more atoms, molecules or edges than the layout allows.
    ``with_forces``: give the batch target forces (zeros on padding); None: when every
    molecule has them. Say so for a batch that may hold no molecule (an epoch's all-padding
    tail), so that it keeps the run's batch shape.
    """
    molecules = [m for pack in packs for m in pack]
    arrays = _molecule_arrays(molecules, layout.cutoff, with_forces)
    bounds = np.cumsum([0, *(len(pack) for pack in packs)])
    members = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]  # rows of arrays
    return assemble_batch(arrays, layout, members)


def _molecule_arrays(
    molecules: Sequence[PackMolecule], cutoff: float | None, with_forces: bool | None
) -> FeedArrays:
    """CPU feed arrays of ``molecules`` (in this order), with their radius or periodic pairs
    within ``cutoff`` (None: knn graphs, no pairs)."""
    sizes = np.array([len(m.z) for m in molecules], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    z = np.concatenate([np.zeros(0, np.uint8), *(np.asarray(m.z) for m in molecules)])
    pos = np.concatenate(
        [np.zeros((0, 3), np.float32), *(np.asarray(m.pos, np.float32) for m in molecules)]
    )
    if with_forces is None:
        with_forces = bool(molecules) and all(m.forces is not None for m in molecules)
    forces = None
    if with_forces:
        if any(m.forces is None for m in molecules):
            raise LoaderError("with_forces=True, but a molecule has no forces")
        forces = np.concatenate(
            [np.zeros((0, 3), np.float32), *(np.asarray(m.forces, np.float32) for m in molecules)]
        )
    pairs, cells = None, None
    if any(m.cell is not None for m in molecules):
        cells, pairs = _periodic_frames(molecules, cutoff)
    elif cutoff is not None:
        found = [molecule_pairs(m.pos, cutoff) for m in molecules]
        counts = np.array([len(i) for i, _ in found], dtype=np.int64)
        i = torch.cat([torch.zeros(0, dtype=torch.int64), *(i for i, _ in found)]).numpy()
        j = torch.cat([torch.zeros(0, dtype=torch.int64), *(j for _, j in found)]).numpy()
        pairs = RadiusPairs(i, j, np.concatenate([[0], np.cumsum(counts)]), cutoff)
    index = np.array([m.index for m in molecules], dtype=np.int64)
    return FeedArrays.build(
        z, pos, forces, offsets, np.array([m.y for m in molecules], dtype=np.float64), pairs,
        ids=index, source="the given molecules", store_index=index, cell=cells,
    )  # fmt: skip


def _periodic_frames(
    molecules: Sequence[PackMolecule], cutoff: float | None
) -> tuple[np.ndarray, PeriodicPairs]:
    """Cells float32 [M, 3, 3] (zeros for a molecule without one) and the periodic pairs of
    ``molecules`` (:func:`~schnet_ipu.data.periodic_pairs.frame_pairs`; radius graphs only)."""
    if cutoff is None:
        raise LoaderError("periodic frames need a radius graph (model.graph: radius)")
    cells = np.zeros((len(molecules), 3, 3))
    found = []
    for m, molecule in enumerate(molecules):
        pbc = np.zeros(3, bool)
        if molecule.cell is not None:
            cells[m] = molecule.cell
            pbc = np.ones(3, bool) if molecule.pbc is None else np.asarray(molecule.pbc, bool)
        found.append(frame_pairs(molecule.pos, cells[m], pbc, cutoff))
    counts = np.array([len(i) for i, _, _ in found], dtype=np.int64)
    pairs = PeriodicPairs(
        i=np.concatenate([np.zeros(0, np.int64), *(i for i, _, _ in found)]),
        j=np.concatenate([np.zeros(0, np.int64), *(j for _, j, _ in found)]),
        offsets=np.concatenate([[0], np.cumsum(counts)]),
        cutoff=cutoff,
        shift=np.concatenate([np.zeros((0, 3), np.int8), *(s for _, _, s in found)]),
    )
    return cells, pairs
