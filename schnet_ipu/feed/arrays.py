"""A split's source data, flat: what the assembly gathers batches from.

:class:`FeedArrays` holds the molecules as torch tensors on one device (CPU, or the
training device when the data is device-resident): the store's concatenated atoms,
per-molecule offsets, targets and, for radius graphs, the pairs file's pairs as an (i, j)
table. Every per-atom and per-pair array ends in one padding entry, which the padding atoms
and padding edges of a batch read. Periodic stores add each frame's cell and each pair's
cell shift; stores with partial labels add per-frame label masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.pairs_file import RadiusPairs
from schnet_ipu.data.periodic_pairs import PeriodicPairs
from schnet_ipu.feed.layout import Layout, LoaderError


@dataclass
class FeedArrays:
    """Flat source arrays of M molecules and A atoms (P radius pairs), all on ``device``;
    every per-atom and per-pair array ends in one padding entry."""

    z: Tensor  # uint8 [A + 1] atomic numbers; entry A is the padding atom (0)
    pos: Tensor  # float32 [A + 1, 3]
    forces: Tensor | None  # float32 [A + 1, 3], stores with forces only
    atom_start: Tensor  # int64 [M] first atom of each molecule
    num_atoms: Tensor  # int64 [M]
    y: Tensor  # float32 [M] targets
    pair_ij: Tensor | None  # int16 (or int32) [P + 1, 2] local (i, j), i < j, radius graphs
    # only; entry P is the padding pair (0, 0)
    pair_start: Tensor | None  # int64 [M] first pair of each molecule
    pair_count: Tensor | None  # int64 [M]
    ids: np.ndarray  # int64 [M] record ids, for error messages
    source: str  # where the molecules come from, for error messages
    store_index: Tensor | None = None  # int64 [M] molecule_index of each; None: 0..M-1
    cell: Tensor | None = None  # float32 [M, 3, 3] lattice vectors (rows); periodic stores only
    pair_shift: Tensor | None = None  # int8 [P + 1, 3] cell shift S of each pair (last: 0);
    # periodic stores' radius graphs only
    stress: Tensor | None = None  # float32 [M, 3, 3] target stress; stores with stress only
    forces_mask: Tensor | None = None  # bool [M] frame carries forces; partial forces only
    stress_mask: Tensor | None = None  # bool [M] frame carries stress; partial stress only

    @classmethod
    def from_store(
        cls,
        store: MoleculeStore,
        targets: np.ndarray,
        pairs: RadiusPairs | None,
        device="cpu",
        atoms: tuple[np.ndarray, np.ndarray] | None = None,
        molecules: np.ndarray | None = None,
    ) -> FeedArrays:
        """The whole store (``targets`` [M]), on ``device``; ``pairs``: the store's radius
        pairs (:func:`~schnet_ipu.data.pairs.radius_pairs`) for radius graphs, else None;
        ``atoms``: the store's (z, pos) when the caller has read them already.
        ``molecules`` (int [K], ascending store indices): only these, whose atoms are all
        that is read (:meth:`~schnet_ipu.data.MoleculeStore.atoms_of`); their rows here are
        0..K-1 and their batches' ``molecule_index`` the store's."""
        every = molecules is None
        pick = slice(None) if every else np.asarray(molecules, dtype=np.int64)
        try:
            if every:
                z, pos = store.concatenated() if atoms is None else atoms
                offsets = store.offsets
                forces = store.forces() if store.has_forces else None
            else:
                z, pos, offsets = store.atoms_of(pick)
                forces = store.forces_of(pick) if store.has_forces else None
            cell = store.cells()[0][pick] if store.periodic else None
            stress = store.stress()[pick] if store.has_stress else None
            partial = store.partial_labels
            forces_mask = store.forces_mask()[pick] if "forces" in partial else None
            stress_mask = store.stress_mask()[pick] if "stress" in partial else None
        except OSError as err:
            raise LoaderError(f"cannot read the molecules of {store.path}: {err}") from err
        source = str(store.path)
        arrays = cls.build(
            z,
            pos,
            forces,
            offsets,
            np.asarray(targets)[pick],
            pairs if every or pairs is None else pairs.of(pick),
            store.ids[pick],
            source,
            store_index=None if every else pick,
            cell=cell,
            stress=stress,
            forces_mask=forces_mask,
            stress_mask=stress_mask,
        )
        return arrays.to(device)

    @classmethod
    def build(
        cls,
        z: np.ndarray,
        pos: np.ndarray,
        forces: np.ndarray | None,
        offsets: np.ndarray,
        targets: np.ndarray,
        pairs: RadiusPairs | None,
        ids: np.ndarray,
        source: str,
        store_index: np.ndarray | None = None,
        cell: np.ndarray | None = None,
        stress: np.ndarray | None = None,
        forces_mask: np.ndarray | None = None,
        stress_mask: np.ndarray | None = None,
    ) -> FeedArrays:
        """CPU feed arrays from numpy: ``offsets`` int [M + 1] splits z [A] / pos [A, 3];
        ``cell`` [M, 3, 3] for periodic stores (whose ``pairs`` are PeriodicPairs), and
        their target ``stress`` [M, 3, 3] when the store has it; ``forces_mask`` /
        ``stress_mask`` bool [M] when only some frames carry forces / stress.

        Each per-atom and per-pair array gets one zero entry at its end: padding atoms and
        padding edges of a batch are gathered from it (z 0, position 0, local atoms 0, no
        shift).
        """
        if cell is None and isinstance(pairs, PeriodicPairs):
            raise LoaderError(f"{source}: periodic pairs need the frames' cells")
        offsets = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        pair_offsets = None if pairs is None else torch.from_numpy(pairs.offsets)
        return cls(
            z=_with_zero_entry(np.asarray(z, dtype=np.uint8)),
            pos=_with_zero_entry(np.asarray(pos, dtype=np.float32)),
            forces=None if forces is None else _with_zero_entry(forces),
            atom_start=offsets[:-1],
            num_atoms=offsets.diff(),
            y=torch.from_numpy(np.asarray(targets)).to(torch.float32),
            pair_ij=None if pairs is None else _pair_table(pairs),
            pair_start=None if pairs is None else pair_offsets[:-1],
            pair_count=None if pairs is None else pair_offsets.diff(),
            ids=np.asarray(ids, dtype=np.int64),
            source=source,
            store_index=None if store_index is None else torch.as_tensor(store_index),
            cell=None if cell is None else torch.from_numpy(np.asarray(cell, np.float32)),
            stress=None if stress is None else torch.from_numpy(np.asarray(stress, np.float32)),
            forces_mask=None if forces_mask is None else torch.from_numpy(_bools(forces_mask)),
            stress_mask=None if stress_mask is None else torch.from_numpy(_bools(stress_mask)),
            pair_shift=(
                _with_zero_entry(pairs.shift) if isinstance(pairs, PeriodicPairs) else None
            ),
        )

    def to(self, device: torch.device | str) -> FeedArrays:
        moved = {
            name: value.to(device) if isinstance(value, Tensor) else value
            for name, value in self.__dict__.items()
        }
        return FeedArrays(**moved)

    @property
    def device(self) -> torch.device:
        return self.pos.device

    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for v in self.__dict__.values() if isinstance(v, Tensor)
        )

    def name(self, molecule: int) -> str:
        return f"molecule {molecule} (record {int(self.ids[molecule])}) of {self.source}"

    @property
    def label_masks(self) -> int:
        """How many per-frame label masks the batches carry (0, 1 or 2)."""
        return (self.forces_mask is not None) + (self.stress_mask is not None)

    def batch_bytes(self, layout: Layout) -> int:
        """Bytes of one batch assembled from these arrays."""
        return layout.batch_bytes(
            self.forces is not None,
            self.cell is not None,
            self.stress is not None,
            self.label_masks,
        )


def _bools(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.bool_)


def _pair_table(pairs: RadiusPairs) -> Tensor:
    """[P + 1, 2] local (i, j) as int16 (int32 for molecules of 2**15 atoms or more, the dtype
    of a batch's atom rows: a gathered pair needs no conversion), ending in the padding
    pair (0, 0). Allocated by torch (why: :class:`~schnet_ipu.feed.chunk.OutputBuffers`), filled
    by numpy (its strided copies are ~3x torch's here)."""
    dtype = torch.int16 if int(pairs.j.max(initial=0)) < 2**15 else torch.int32
    table = torch.empty((len(pairs.i) + 1, 2), dtype=dtype)
    rows = table.numpy()
    rows[:-1, 0], rows[:-1, 1], rows[-1] = pairs.i, pairs.j, 0
    return table


def _with_zero_entry(values: np.ndarray) -> Tensor:
    """values [L, ...] -> tensor [L + 1, ...] ending in zeros (one copy)."""
    source = torch.from_numpy(np.ascontiguousarray(values))
    out = source.new_zeros((len(values) + 1, *values.shape[1:]))
    out[:-1] = source
    return out
