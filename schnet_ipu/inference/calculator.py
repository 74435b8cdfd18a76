"""Trained models as an ASE calculator: relaxations, molecular dynamics, anything ASE drives.

    atoms.calc = SchNetCalculator("runs/emt_forces")               # a run folder
    atoms.calc = SchNetCalculator("best.pt")                        # a model file, alone
    atoms.calc = SchNetCalculator(["a/best.pt", "b/best.pt"])       # an ensemble
    BFGS(atoms).run(fmax=0.05)

Energies are in the unit of the run's target (eV for data imported with ``data.source=ase``),
forces are ``-dE/dpos`` by autograd in that unit per Angstrom; periodic ``Atoms`` (a cell and
any ``pbc``) also get the stress (ASE's Voigt order and sign, eV/Angstrom^3), so cell filters
relax them and NPT dynamics runs. The model runs in float64 by
default, so energies are smooth enough for finite differences and long trajectories; pass
``dtype=torch.float32`` for speed. An ensemble gives the members' mean and, in
``results["energy_std"]`` and ``results["forces_std"]``, their spread.
"""

from __future__ import annotations

import torch
from ase.calculators.calculator import Calculator, all_changes

from schnet_ipu.data.ase_files import check_frame, frame_cell
from schnet_ipu.inference.predictor import ModelPaths, Predictor, voigt


class SchNetCalculator(Calculator):
    """``energy``, ``free_energy`` (the same), ``forces`` and, for periodic ``Atoms``,
    ``stress`` from checkpoint files or run folders (``checkpoint``: "best" or "last")."""

    implemented_properties = (
        "energy",
        "free_energy",
        "forces",
        "stress",
        "energy_std",
        "forces_std",
        "stress_std",
    )

    def __init__(
        self,
        model: ModelPaths,
        checkpoint: str = "best",
        dtype: torch.dtype = torch.float64,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.predictor = Predictor(model, checkpoint, dtype)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        where = "SchNetCalculator: atoms"
        z, pos = check_frame(self.atoms, where)
        cell, pbc = frame_cell(self.atoms, where)
        result = self.predictor.predict(z, pos, where, cell, pbc)
        self.results = {
            "energy": result.energy,
            "free_energy": result.energy,
            "forces": result.forces,
        }
        if result.stress is not None:
            self.results["stress"] = voigt(result.stress)
        if len(self.predictor.paths) > 1:
            self.results["energy_std"] = result.energy_std
            self.results["forces_std"] = result.forces_std
            if result.stress_std is not None:
                self.results["stress_std"] = voigt(result.stress_std)
