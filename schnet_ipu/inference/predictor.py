"""Energies and forces of trained models on new structures: one model, or an ensemble.

    predictor = Predictor(["runs/a/checkpoints/best.pt", "runs/b"], dtype=torch.float64)
    result = predictor.predict(z, pos)            # Prediction: energy, forces, their spread
    predict_file(["model.pt"], Path("new.extxyz"), Path("out.extxyz"))

Each model is a checkpoint file or a run folder (its best checkpoint); nothing else of the
run is read, so a model file copied to another machine works there alone. Every structure
is evaluated on its own, float32 as trained or float64 when asked, with the weights of
:class:`~schnet_ipu.inference.portable.PortableSchNet` (no packing) over a half list of pairs
(:func:`half_list`: all distances in a compiled loop for molecules under
``MOLECULE_PAIRS_ATOMS`` atoms, else vesin's O(N) cell list; knn models search their own),
molecules and periodic frames (a cell and any ``pbc``) alike; periodic frames get the
stress too (ASE's convention, eV/Angstrom^3). A model trained with ``model.filter=table``
runs :mod:`schnet_ipu.model.direct_forces` (its table in numba's fused loops, the backward
written out: no autograd); ``exact`` ones run their filter network per pair under
autograd. An ensemble's
prediction is the members' mean; the ``*_std`` fields are their spread (population
standard deviation over members, 0 for one model).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union  # typing's forms: a runtime alias on Python 3.8

import numpy as np
import torch

try:
    import vesin
except ImportError:  # Python < 3.10 (pyproject.toml installs vesin from 3.10 on)
    vesin = None

from schnet_ipu.config import ConfigError
from schnet_ipu.data.ase_files import check_frame, frame_cell, read_frames, write_extxyz
from schnet_ipu.errors import CheckpointError
from schnet_ipu.inference.cell_list import neighbour_pairs
from schnet_ipu.inference.model_file import ModelSpec, load_trained
from schnet_ipu.inference.portable import PortableSchNet
from schnet_ipu.model.direct_forces import Dense, DirectTableSchNet, TableBlock
from schnet_ipu.model.ops import pair_loops

log = logging.getLogger("schnet_ipu")

# Below this many atoms a structure is evaluated on one intra-op thread (the fused table
# loops always run on one). Float32 energy + forces (+ stress), 2-core box, one thread
# against two: 20-atom molecule 3.2 against 8.5 ms (quiet); 200-atom molecule 16.0 against
# 31.3 ms, 200-atom Cu cell 5.7 against 7.5, 1,000-atom Cu cell 19.8 against 28.5 (load
# 1.1-1.2); at load 8 the two-thread calls took 15-60x longer (torch's pool waits on its
# descheduled thread). 10,000 atoms keep torch's threads: not measured on a quiet box.
ONE_THREAD_ATOMS = 2000
# Below this many atoms a molecule's pairs come from all N (N - 1) / 2 distances in a
# compiled loop rather than vesin's cell list (see half_list)
MOLECULE_PAIRS_ATOMS = 2000

ModelPaths = Union[str, Path, Sequence[Union[str, Path]]]  # one model file/run, or several


@dataclass
class Prediction:
    """One structure's prediction: energy in the model's unit, forces [n, 3] in its unit per
    Angstrom (float64), and their spread over an ensemble's members."""

    energy: float
    forces: np.ndarray
    energy_std: float
    forces_std: np.ndarray
    stress: np.ndarray | None = None  # [3, 3] periodic frames only
    stress_std: np.ndarray | None = None


def model_paths(models: ModelPaths) -> list[Path]:
    """One path, or several, as a list."""
    if isinstance(models, (str, Path)):
        return [Path(models)]
    paths = [Path(m) for m in models]
    if not paths:
        raise CheckpointError("no model given: pass a checkpoint file or run folder")
    return paths


class Predictor:
    """Trained models (checkpoint files or run folders) ready for new structures.

    ``checkpoint`` picks "best" or "last" in run folders; ``dtype=torch.float64`` evaluates
    in double precision (smooth energies for finite differences and long MD).
    """

    def __init__(
        self, models: ModelPaths, checkpoint: str = "best", dtype: torch.dtype = torch.float32
    ) -> None:
        members = [load_trained(path, checkpoint) for path in model_paths(models)]
        units = {m.spec.unit for m in members}
        if len(units) > 1:
            raise CheckpointError(f"an ensemble needs one energy unit; its members use {units}")
        self.specs: list[ModelSpec] = [m.spec for m in members]
        # frozen: autograd then follows the positions alone, and the fused table loops skip
        # the gradients of what needs none (the table, the first block's input)
        self.modules = [
            PortableSchNet.from_trained(m, dtype, fused=True).requires_grad_(False) for m in members
        ]
        # radius models with the table filter: energy and forces without autograd
        self.direct = [
            direct_model(module) if module.fused and spec.model["graph"] == "radius" else None
            for spec, module in zip(self.specs, self.modules)
        ]
        self.dtype = dtype
        self.unit = members[0].spec.unit
        self.forces_unit = members[0].spec.forces_unit

    def predict(
        self,
        z: np.ndarray,
        pos: np.ndarray,
        where: str = "structure",
        cell: np.ndarray | None = None,
        pbc: np.ndarray | None = None,
    ) -> Prediction:
        """The prediction for atomic numbers ``z`` [n] and positions ``pos`` [n, 3] in
        Angstrom, periodic when ``cell`` [3, 3] (rows) and some ``pbc`` [3] are given; an
        element a member never saw raises a ConfigError naming ``where``."""
        for spec in self.specs:
            spec.check_elements(np.asarray(z), where)
        periodic = cell is not None and pbc is not None and bool(np.any(pbc))
        z = np.asarray(z, dtype=np.int64)
        pos = np.ascontiguousarray(pos, dtype=np.float64)
        box = np.ascontiguousarray(cell, np.float64) if periodic else np.zeros((3, 3))
        pairs = {}  # half lists by cutoff: members of an ensemble share them
        results = []
        threads = 1 if len(z) < ONE_THREAD_ATOMS else torch.get_num_threads()
        with intra_op_threads(threads):
            for spec, module, direct in zip(self.specs, self.modules, self.direct):
                if spec.model["graph"] != "radius":
                    if periodic:
                        raise ConfigError(f"{where}: periodic frames need a radius-graph model")
                    pos_t = torch.from_numpy(pos).to(self.dtype)
                    energy, force = module(torch.from_numpy(z), pos_t)
                    results.append((float(energy), force.double().numpy(), None))
                    continue
                if spec.cutoff not in pairs:
                    pairs[spec.cutoff] = half_list(pos, box, pbc, spec.cutoff, periodic)
                i, j, shift = pairs[spec.cutoff]
                if direct is not None:
                    energy, force, virial = direct.energy_forces(z, pos, i, j, shift, box)
                else:
                    offsets = shift @ box if periodic else np.zeros((len(i), 3))
                    energy, force_t, virial_t = module.forward_edges(
                        torch.from_numpy(z), torch.from_numpy(pos),
                        torch.from_numpy(np.stack([i, j])), torch.from_numpy(offsets), False,
                    )  # fmt: skip
                    energy, force = float(energy), force_t.double().numpy()
                    virial = virial_t.double().numpy()
                stress = -virial / abs(np.linalg.det(box)) if periodic else None
                results.append((float(energy), force, stress))
        if len(results) == 1:  # one model: no spread to compute (np.std costs ~20 us)
            energy, force, stress = results[0]
            spread = None if stress is None else np.zeros_like(stress)
            return Prediction(energy, force, 0.0, np.zeros_like(force), stress, spread)
        energies = np.array([energy for energy, _, _ in results])
        forces = np.stack([force for _, force, _ in results])
        stress = np.stack([s for _, _, s in results]) if periodic else None
        return Prediction(
            energy=float(energies.mean()),
            forces=forces.mean(axis=0),
            energy_std=float(energies.std()),
            forces_std=forces.std(axis=0),
            stress=None if stress is None else stress.mean(axis=0),
            stress_std=None if stress is None else stress.std(axis=0),
        )


def half_list(
    pos: np.ndarray, box: np.ndarray, pbc: np.ndarray | None, cutoff: float, periodic: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The half list of one structure as (i, j int64 [P], shift float64 [P, 3]; [0, 3] for
    a molecule), edge vector ``pos[j] - pos[i] + shift @ box``; each pair once.

    Molecules under ``MOLECULE_PAIRS_ATOMS`` atoms: every distance in a compiled loop
    (:func:`schnet_ipu.model.ops.pair_loops.molecule_pairs`). Otherwise vesin's O(N) cell
    list, pairs as they come, without
    :func:`~schnet_ipu.data.periodic_pairs.frame_pairs`' canonical form, which the
    symmetric evaluation does not need: 10,000 Cu atoms 26 against 40 ms. Without vesin
    (its wheels need Python 3.10; the IPU SDK's is 3.8) the torch-ops cell list the
    exported file uses (:func:`schnet_ipu.inference.cell_list.neighbour_pairs`, ~10x slower)."""
    molecule_shift = np.zeros((0, 3))
    if not periodic and pair_loops.AVAILABLE and len(pos) < MOLECULE_PAIRS_ATOMS:
        i, j = pair_loops.molecule_pairs(pos, float(cutoff))
        return i, j, molecule_shift
    if vesin is None:
        i, j, shift = neighbour_pairs(
            torch.from_numpy(pos),
            torch.from_numpy(box) if periodic else None,
            torch.as_tensor(np.asarray(pbc, bool)) if periodic else None,
            float(cutoff),
        )
        shift = shift.numpy() if periodic else molecule_shift
        return i.numpy(), j.numpy(), shift
    flags = np.asarray(pbc, bool).tolist() if periodic else [False, False, False]
    search = vesin.NeighborList(cutoff=float(cutoff), full_list=False, n_threads=1)
    i, j, shift = search.compute(pos, box, flags, quantities="ijS")
    shift = shift.astype(np.float64) if periodic else molecule_shift
    return i.astype(np.int64), j.astype(np.int64), shift


def direct_model(module: PortableSchNet) -> DirectTableSchNet:
    """A fused table-filter module's weights (frozen) as the hand-derived energy + forces of
    :mod:`schnet_ipu.model.direct_forces`."""
    blocks = [
        TableBlock(
            lin1=Dense.of(block.conv.lin1.weight, None),
            coefficients=block.coefficients.detach().contiguous().numpy(),
            lin2=Dense.of(block.conv.lin2.weight, block.conv.lin2.bias),
            lin=Dense.of(block.lin.weight, block.lin.bias),
        )
        for block in module.interactions
    ]
    return DirectTableSchNet(
        embedding=module.embedding.weight,
        blocks=blocks,
        readout1=Dense.of(module.lin1.weight, module.lin1.bias),
        readout2=Dense.of(module.lin2.weight, module.lin2.bias),
        atomref=module.atomref.weight.detach()[:, 0].double().numpy(),
        atom_reference=module.atom_reference.double().numpy(),
        mean=module.mean,
        std=module.std,
        mean_readout=module.mean_readout,
        cutoff=module.cutoff,
        filter_points=module.filter_points,
    )


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count is ``count`` inside the block (set back after)."""
    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != previous:
            torch.set_num_threads(previous)


def predict_file(models: ModelPaths, input_path: Path, out: Path) -> int:
    """Predict every frame of ``input_path`` (any ASE-readable file) and write them to ``out``
    (extxyz) with ``info["energy"]`` and ``arrays["forces"]``, ``info["stress"]`` (Voigt)
    for periodic frames, plus ``info["energy_std"]`` and ``arrays["forces_std"]`` for an
    ensemble. Returns the frame count."""
    from ase import Atoms

    frames = read_frames(input_path)
    places = [f"{input_path}, frame {i}" for i in range(len(frames))]
    structures = [(*check_frame(a, at), *frame_cell(a, at)) for a, at in zip(frames, places)]
    predictor = Predictor(models)
    ensemble = len(predictor.modules) > 1
    written = []
    for atoms, (z, pos, cell, pbc), at in zip(frames, structures, places):
        result = predictor.predict(z, pos, at, cell, pbc)
        written_atoms = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
        labels = ("energy", "stress")  # the file's own, replaced by the prediction
        written_atoms.info.update({k: v for k, v in atoms.info.items() if k not in labels})
        written_atoms.info["energy"] = result.energy
        written_atoms.arrays["forces"] = result.forces
        if result.stress is not None:
            written_atoms.info["stress"] = voigt(result.stress)
        if ensemble:
            written_atoms.info["energy_std"] = result.energy_std
            written_atoms.arrays["forces_std"] = result.forces_std
        written.append(written_atoms)
    write_extxyz(written, out)
    return len(written)


def voigt(stress: np.ndarray) -> np.ndarray:
    """A [3, 3] stress as ASE's Voigt [6]: xx, yy, zz, yz, xz, xy."""
    return stress[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
