"""The HDF5 molecule store's file layout (schema version 2), and the one place that writes it.

Layout (M molecules, A atoms in total)::

    /z         uint8   [A]     atomic numbers, molecules concatenated
    /pos       float32 [A, 3]  positions in Angstrom
    /offsets   int64   [M + 1] molecule i owns atoms offsets[i]:offsets[i + 1]
    /ids       int64   [M]     record id in the source (QM9: gdb index)
    /forces    float32 [A, 3]  optional per-atom forces; attrs: unit (e.g. eV/Angstrom)
    /cell      float64 [M, 3, 3] optional (periodic stores): lattice vectors as rows, Angstrom;
                               zeros for a frame without a cell (a molecule)
    /pbc       bool    [M, 3]  with /cell: periodic along each cell vector
    /stress    float64 [M, 3, 3] optional, with /cell: ASE's stress (sign and convention);
                               attrs: unit (eV/Angstrom^3)
    /forces_mask bool  [M]     optional, with /forces: frame m carries forces (version 2)
    /stress_mask bool  [M]     optional, with /stress: frame m carries stress (version 2)
    /targets/<name>  float64 [M]    attrs: unit, description
    /atomrefs/<name> float64 [119]  optional per-element reference in the target's unit

Root attributes: schema, schema_version, source, source_version, synthetic, num_molecules,
num_atoms, created (ISO time), plus anything an importer adds.

Partial labels (version 2): a store where only some frames carry forces or stress holds
zeros for the others and a per-frame mask saying which do. Without a mask every frame
carries the forces of ``/forces``, and every frame with pbc the stress of ``/stress`` (the
version-1 meaning). A store with a mask is written as version 2, one without as version 1,
so that code older than the masks opens every store it can read right and refuses the
others (it would take their zeros for labels); the reader (:mod:`.store`) reads both.

Both writers (:func:`~schnet_ipu.data.writer.write_store`, all at once, and
:class:`~schnet_ipu.data.writer.StoreWriter`, streamed) create the file with
:func:`create_layout` and fill it with :func:`write_frames`; they check what they are given
first (:mod:`.checks`).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

SCHEMA = "schnet-ipu-molecule-store"
SCHEMA_VERSION = 2  # the newest version this code writes: version 1 + forces/stress masks
READABLE_VERSIONS = (1, 2)

# Chunking: 512 atoms per chunk (pos chunk = 6 KiB raw), so a random molecule read
# decompresses one or two small chunks. Measured on full QM9 (2 shared cores): LZF with 512-atom
# chunks reads ~11k molecules/s from a 28 MB file; gzip or 8k-atom chunks read 2-5x slower
# for a file only ~10% smaller.
ATOM_CHUNK = 512
MOLECULE_CHUNK = 65536
COMPRESSION = "lzf"


@dataclass(frozen=True)
class Header:
    """What a store holds besides its frames' rows: fixed when the file is created."""

    offsets: np.ndarray  # int64 [M + 1]
    units: Mapping[str, str]  # target name -> unit, in the store's target order
    descriptions: Mapping[str, str] = field(default_factory=dict)  # target name -> text
    attrs: Mapping[str, Any] = field(default_factory=dict)  # the importer's root attributes
    forces_unit: str | None = None  # the store holds /forces, in this unit
    periodic: bool = False  # the store holds /cell and /pbc
    stress_unit: str | None = None  # the store holds /stress, in this unit
    label_masks: tuple[str, ...] = ()  # labels only some frames carry: "forces", "stress"
    atomrefs: Mapping[str, np.ndarray] = field(default_factory=dict)  # name -> float64 [119]


@dataclass(frozen=True)
class Frames:
    """m consecutive frames (a atoms) as the layout holds them; None: the store has none."""

    offsets: np.ndarray  # int64 [m + 1] from 0: frame k owns atoms offsets[k]:offsets[k + 1]
    z: np.ndarray  # int [a] atomic numbers (uint8 once written)
    pos: np.ndarray  # float32 [a, 3]
    ids: np.ndarray  # int64 [m]
    targets: Mapping[str, np.ndarray]  # name -> float64 [m]
    forces: np.ndarray | None = None  # float32 [a, 3]
    cell: np.ndarray | None = None  # float64 [m, 3, 3]
    pbc: np.ndarray | None = None  # bool [m, 3]
    stress: np.ndarray | None = None  # float64 [m, 3, 3]
    masks: Mapping[str, np.ndarray] = field(default_factory=dict)  # label -> bool [m]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def select(self, keep: np.ndarray) -> Frames:
        """The frames ``keep`` (int [k], increasing), atoms and labels with them."""
        atoms = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in keep])

        def rows(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else values[keep]

        return dataclasses.replace(
            self,
            offsets=np.concatenate([[0], np.cumsum(np.diff(self.offsets)[keep])]),
            z=self.z[atoms],
            pos=self.pos[atoms],
            ids=self.ids[keep],
            targets={name: values[keep] for name, values in self.targets.items()},
            forces=None if self.forces is None else self.forces[atoms],
            cell=rows(self.cell),
            pbc=rows(self.pbc),
            stress=rows(self.stress),
            masks={name: mask[keep] for name, mask in self.masks.items()},
        )


def create_layout(f: h5py.File, header: Header) -> None:
    """Create every dataset of the store ``header`` describes in the empty file ``f``
    (preallocated, filled by :func:`write_frames`; offsets and atom references written),
    and its root attributes."""
    molecules, atoms = len(header.offsets) - 1, int(header.offsets[-1])

    def dataset(name: str, rows: int, row: tuple[int, ...], dtype, chunk: int) -> h5py.Dataset:
        return f.create_dataset(
            name,
            shape=(rows, *row),
            dtype=dtype,
            chunks=(min(chunk, max(rows, 1)), *row),
            compression=COMPRESSION,
            shuffle=byte_shuffle(dtype),
        )

    dataset("z", atoms, (), np.uint8, ATOM_CHUNK)
    dataset("pos", atoms, (3,), np.float32, ATOM_CHUNK)
    dataset("offsets", molecules + 1, (), np.int64, MOLECULE_CHUNK)[:] = header.offsets
    dataset("ids", molecules, (), np.int64, MOLECULE_CHUNK)
    if header.forces_unit is not None:
        forces = dataset("forces", atoms, (3,), np.float32, ATOM_CHUNK)
        forces.attrs["unit"] = header.forces_unit
    if header.periodic:
        dataset("cell", molecules, (3, 3), np.float64, MOLECULE_CHUNK)
        dataset("pbc", molecules, (3,), np.bool_, MOLECULE_CHUNK)
    if header.stress_unit is not None:
        stress = dataset("stress", molecules, (3, 3), np.float64, MOLECULE_CHUNK)
        stress.attrs["unit"] = header.stress_unit
    for name in header.label_masks:
        dataset(f"{name}_mask", molecules, (), np.bool_, MOLECULE_CHUNK)
    f.create_group("targets", track_order=True)
    for name, unit in header.units.items():
        target = dataset(f"targets/{name}", molecules, (), np.float64, MOLECULE_CHUNK)
        target.attrs["unit"] = unit
        target.attrs["description"] = header.descriptions.get(name, name)
    for name, ref in header.atomrefs.items():
        f.create_dataset(f"atomrefs/{name}", data=ref)
    f.attrs.update(
        {
            "source": "unknown",
            "source_version": "",
            "synthetic": False,
            **header.attrs,
            "schema": SCHEMA,
            # 2 with label masks, else 1: see the module docstring
            "schema_version": SCHEMA_VERSION if header.label_masks else READABLE_VERSIONS[0],
            "num_molecules": molecules,  # the counts: the importer's attrs cannot override them
            "num_atoms": atoms,
        }
    )


def write_frames(f: h5py.File, frames: Frames, first: int, first_atom: int) -> None:
    """Write ``frames`` into a file laid out by :func:`create_layout` as its frames
    ``first``.. and atoms ``first_atom``.. (what ``frames`` leaves None the store lacks)."""
    rows = slice(first, first + len(frames))
    atoms = slice(first_atom, first_atom + int(frames.offsets[-1]))
    for name, values in frames.targets.items():
        f[f"targets/{name}"][rows] = values
    f["z"][atoms] = frames.z.astype(np.uint8)
    f["pos"][atoms] = frames.pos
    f["ids"][rows] = frames.ids
    if frames.forces is not None:
        f["forces"][atoms] = frames.forces
    for name, values in (("cell", frames.cell), ("pbc", frames.pbc), ("stress", frames.stress)):
        if values is not None:
            f[name][rows] = values
    for name, mask in frames.masks.items():
        f[f"{name}_mask"][rows] = mask


def mark_created(f: h5py.File) -> None:
    """Stamp the store's ``created`` attribute (now, UTC): pairs files name their store by it."""
    f.attrs["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat()


def byte_shuffle(dtype: np.dtype) -> bool:
    """Whether a dataset of ``dtype`` is byte-shuffled before LZF: multi-byte integers and
    float64 targets, not float32 coordinates or forces. Shuffling QM9's positions saved 7% of
    their 28 MB but made reading them all 4x slower (117 vs 29 ms on the 2-core box)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize > 1 and dtype != np.float32
