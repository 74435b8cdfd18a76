"""Energies and forces of trained models on new structures: one model, or an ensemble.

    predictor = Predictor(["runs/a/checkpoints/best.pt", "runs/b"], dtype=torch.float64)
    result = predictor.predict(z, pos)            # Prediction: energy, forces, their spread
    predict_file(["model.pt"], Path("new.extxyz"), Path("out.extxyz"))
    export_model("runs/a", Path("a.torchscript.pt"))   # for LAMMPS, OpenMM-Torch, libtorch

Each model is a checkpoint file or a run folder (its best checkpoint); nothing else of the
run is read, so a model file copied to another machine works there alone. Every structure
is evaluated on its own, float32 as trained or float64 when asked: a molecule or cluster by
:class:`~schnet_ipu.portable.PortableSchNet` (no packing, its own neighbour search), a
periodic frame (a cell and any ``pbc``) by the trained model on one pack of its own size
with vesin's periodic pairs, giving the stress too (:mod:`schnet_ipu.stress`, ASE's
convention, eV/Angstrom^3). An ensemble's prediction is the members' mean; the ``*_std``
fields are their spread (population standard deviation over members, 0 for one model).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union  # typing's forms: a runtime alias on Python 3.8

import numpy as np
import torch

from schnet_ipu.config import ConfigError
from schnet_ipu.data.ase_files import check_frame, frame_cell, read_frames
from schnet_ipu.data.periodic_pairs import frame_pairs
from schnet_ipu.errors import CheckpointError
from schnet_ipu.loader import Layout, PackMolecule, collate
from schnet_ipu.model import SchNet
from schnet_ipu.model_file import ModelSpec, load_trained
from schnet_ipu.portable import PortableSchNet
from schnet_ipu.stress import energy_forces_stress

log = logging.getLogger("schnet_ipu")

# Below this many atoms a structure is evaluated on one intra-op thread: a 20-atom molecule
# took 3.2 ms on one thread and 8.5 ms on two (float32 energy + forces, quiet 2-core box)
ONE_THREAD_ATOMS = 64

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
        self.modules = [PortableSchNet.from_trained(m).to(dtype) for m in members]
        self.packed = [copy.deepcopy(m.model).to(dtype).eval() for m in members]  # periodic
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
        results = []
        threads = 1 if len(z) < ONE_THREAD_ATOMS else torch.get_num_threads()
        with intra_op_threads(threads):
            for spec, module, packed in zip(self.specs, self.modules, self.packed):
                if periodic:
                    results.append(self._periodic(spec, packed, z, pos, cell, pbc, where))
                    continue
                z_t = torch.as_tensor(np.asarray(z, dtype=np.int64))
                energy, force = module(z_t, torch.as_tensor(np.asarray(pos), dtype=self.dtype))
                results.append((float(energy), force.detach().double().numpy(), None))
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

    def _periodic(
        self,
        spec: ModelSpec,
        model: SchNet,
        z: np.ndarray,
        pos: np.ndarray,
        cell: np.ndarray,
        pbc: np.ndarray,
        where: str,
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(energy, forces [n, 3], stress [3, 3]) of one periodic frame: the trained model on
        one pack of the frame's own size."""
        if spec.model["graph"] != "radius":
            raise ConfigError(f"{where}: periodic frames need a radius-graph model, not knn")
        cutoff = spec.cutoff
        pairs = len(frame_pairs(np.asarray(pos, np.float32), cell, pbc, cutoff)[0])
        layout = Layout(1, len(z), 1, max(2 * pairs, 2), cutoff)
        molecule = PackMolecule(np.asarray(z), np.asarray(pos), 0.0, 0, cell=cell, pbc=pbc)
        batch = collate([[molecule]], layout, with_forces=False)
        batch = dataclasses.replace(  # the frame's own coordinates, not float32's
            batch,
            pos=torch.as_tensor(np.asarray(pos), dtype=self.dtype),
            cell=torch.as_tensor(np.asarray(cell), dtype=self.dtype).unsqueeze(0),
        )
        model.max_nodes_per_pack = len(z)
        energy, forces, stress = energy_forces_stress(model, batch, create_graph=False)
        total = float(energy[0].detach()) + spec.transform.reference(np.asarray(z, dtype=np.int64))
        return total, forces.detach().double().numpy(), stress[0].detach().double().numpy()


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
    import ase.io
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
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    ase.io.write(tmp, written, format="extxyz")
    tmp.replace(out)
    return len(written)


def voigt(stress: np.ndarray) -> np.ndarray:
    """A [3, 3] stress as ASE's Voigt [6]: xx, yy, zz, yz, xz, xy."""
    return stress[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]


def export_model(
    model: str | Path, out: Path, checkpoint: str = "best", dtype: torch.dtype = torch.float32
) -> dict:
    """Write a checkpoint's model as a TorchScript file that plain torch loads
    (``torch.jit.load``) with no import of this package; returns its metadata, which the
    file also holds as ``schnet_ipu.json`` (``_extra_files``).

    TorchScript, not ``torch.export``: the forces are an autograd pass over a neighbour list
    whose length depends on the positions, and ``torch.export`` in torch 2.13 stops on that
    data-dependent size inside the backward (GuardOnDataDependentSymNode); TorchScript keeps
    both, and is what the OpenMM-Torch and LAMMPS plugins load today.
    """
    trained = load_trained(model, checkpoint)
    module = PortableSchNet.from_trained(trained).to(dtype)
    with warnings.catch_warnings():  # TorchScript's deprecation notice: chosen knowingly
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(module)
    meta = {
        "interface": "energy, forces = model(z, pos)",
        "z": "int64 [N] atomic numbers",
        "pos": f"{str(dtype).replace('torch.', '')} [N, 3] Angstrom",
        "energy": f"float64 [] {trained.spec.unit}",
        "forces": f"[N, 3] {trained.spec.forces_unit}",
        "cutoff": trained.spec.cutoff,
        "elements": trained.spec.elements,
        "source": str(trained.path),
        "model_spec": trained.spec.to_dict(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(scripted, str(tmp), _extra_files={"schnet_ipu.json": json.dumps(meta)})
    tmp.replace(out)
    return meta
