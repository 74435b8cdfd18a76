"""Energies and forces of a trained run on new structures (never in a store).

    predictor = Predictor(Path("runs/emt_forces"))
    [(energy, forces)] = predictor.predict([(z, pos)])  # eV-like float, [n, 3]
    predict_file(Path("runs/emt_forces"), Path("new.extxyz"), Path("out.extxyz"))

Structures are packed in their order into packs of the run's training limits (atoms,
molecules, edges), ``packing.packs_per_batch`` packs per batch. A structure larger than a
training pack gets a pack planned for it alone, so nothing is ever refused or dropped. Forces
are ``-dE/dpos`` by autograd; the atom references of the target (QM9) are added back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Tuple

import numpy as np
import torch

from schnet_ipu.data.ase_files import check_frame, read_frames
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.forces import energy_and_forces
from schnet_ipu.loader import Layout, PackMolecule, collate
from schnet_ipu.training import load_run

log = logging.getLogger("schnet_ipu")

Structure = Tuple[np.ndarray, np.ndarray]  # z int [n], pos float [n, 3] in Angstrom; typing's
# form: a runtime alias on Python 3.8


class Predictor:
    """A run's weights (``checkpoint``: best or last) ready for new structures.

    ``dtype=torch.float64`` evaluates the model in double precision (smooth energies for
    finite differences and long MD); float32 is what training used.
    """

    def __init__(
        self, run_dir: Path, checkpoint: str = "best", dtype: torch.dtype = torch.float32
    ) -> None:
        cfg, data, backend = load_run(Path(run_dir), checkpoint)
        self.model = backend.model.to(dtype).eval()
        self.device = backend.device
        self.dtype = dtype
        self.unit = data.unit
        self.forces_unit = data.store.forces_unit or f"{data.unit}/Angstrom"
        plan = data.train_plan
        self.radius = cfg.model.graph == "radius"
        self.cutoff = cfg.model.cutoff
        self.layout = Layout(
            packs_per_batch=cfg.packing.packs_per_batch,
            max_nodes=plan.max_nodes,
            max_graphs=plan.max_graphs,
            max_edges=plan.max_edges if self.radius else None,
            cutoff=self.cutoff if self.radius else None,
        )
        atomref = data.store.atomref(cfg.data.target)
        use_ref = cfg.data.atomrefs and atomref is not None
        self.atomref = atomref if use_ref else np.zeros(119)

    def predict(self, structures: Sequence[Structure]) -> list[tuple[float, np.ndarray]]:
        """(energy, forces float64 [n, 3]) for each structure, in order."""
        results: list[tuple[float, np.ndarray] | None] = [None] * len(structures)
        for layout, packs in self._batches(structures):
            molecules = [
                [PackMolecule(structures[i][0], structures[i][1], 0.0, i) for i in pack]
                for pack in packs
            ]
            placed = self._placement(packs, structures, layout)  # (structure, slot, first atom)
            batch = collate(molecules, layout)
            pos = batch.pos.to(self.dtype)  # the structures' own coordinates, not float32's
            for i, _, node in placed:
                pos[node : node + len(structures[i][0])] = torch.as_tensor(structures[i][1])
            batch = dataclasses.replace(batch, pos=pos).to(self.device)
            self.model.max_nodes_per_pack = layout.max_nodes  # knn graphs search per pack
            energy, forces = energy_and_forces(self.model, batch, create_graph=False)
            energy = energy.detach().double().cpu().numpy()
            forces = forces.detach().double().cpu().numpy()
            for i, slot, node in placed:
                z = np.asarray(structures[i][0], dtype=np.int64)
                shift = float(self.atomref[z].sum())
                results[i] = (float(energy[slot]) + shift, forces[node : node + len(z)])
        return results

    @staticmethod
    def _placement(
        packs: list[list[int]], structures: Sequence[Structure], layout: Layout
    ) -> list[tuple[int, int, int]]:
        """(structure index, molecule slot, first atom row) of each structure, as collated."""
        placed = []
        for p, pack in enumerate(packs):
            node = p * layout.max_nodes
            for slot, i in enumerate(pack):
                placed.append((i, p * layout.max_graphs + slot, node))
                node += len(structures[i][0])
        return placed

    def _edges(self, structure: Structure) -> int:
        """Directed edges of one structure within the cutoff (0 for knn graphs)."""
        if not self.radius:
            return 0
        return 2 * len(molecule_pairs(np.asarray(structure[1], np.float32), self.cutoff)[0])

    def _batches(self, structures: Sequence[Structure]) -> Iterator[tuple[Layout, list[list[int]]]]:
        """(layout, packs of structure indices) per batch: first-fit in order into packs of
        the training limits; a structure too large for one gets a layout of its own size."""
        lay = self.layout
        packs: list[list[int]] = []
        room: list[tuple[int, int]] = []  # atoms, edges left per open pack
        for i, structure in enumerate(structures):
            atoms, edges = len(structure[0]), self._edges(structure)
            if atoms > lay.max_nodes or edges > (lay.max_edges or 0):
                log.info("structure %d (%d atoms) gets a pack of its own size", i, atoms)
                yield (
                    dataclasses.replace(
                        lay,
                        packs_per_batch=1,
                        max_nodes=max(atoms, lay.max_nodes),
                        max_graphs=1,
                        max_edges=max(edges, 2) if self.radius else None,
                    ),
                    [[i]],
                )
                continue
            for p, (free_atoms, free_edges) in enumerate(room):
                if len(packs[p]) < lay.max_graphs and atoms <= free_atoms and edges <= free_edges:
                    packs[p].append(i)
                    room[p] = (free_atoms - atoms, free_edges - edges)
                    break
            else:
                packs.append([i])
                room.append((lay.max_nodes - atoms, (lay.max_edges or 0) - edges))
            if len(packs) > lay.packs_per_batch:  # the oldest pack is full enough: send a batch
                yield lay, packs[: lay.packs_per_batch]
                packs, room = packs[lay.packs_per_batch :], room[lay.packs_per_batch :]
        for first in range(0, len(packs), lay.packs_per_batch):
            yield lay, packs[first : first + lay.packs_per_batch]


def predict_file(run_dir: Path, input_path: Path, out: Path) -> int:
    """Predict every frame of ``input_path`` (any ASE-readable file) and write them to ``out``
    (extxyz) with ``info["energy"]`` and ``arrays["forces"]``. Returns the frame count."""
    import ase.io
    from ase import Atoms

    frames = read_frames(input_path)
    structures = [check_frame(atoms, f"{input_path}, frame {i}") for i, atoms in enumerate(frames)]
    predictor = Predictor(run_dir)
    results = predictor.predict(structures)
    written = []
    for atoms, (energy, forces) in zip(frames, results):
        copy = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
        copy.info.update({k: v for k, v in atoms.info.items() if k != "energy"})
        copy.info["energy"] = energy
        copy.arrays["forces"] = forces
        written.append(copy)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    ase.io.write(tmp, written, format="extxyz")
    tmp.replace(out)
    return len(written)
