"""A trained run as an ASE calculator: relaxations, molecular dynamics, anything ASE drives.

    atoms.calc = SchNetCalculator("runs/emt_forces")
    BFGS(atoms).run(fmax=0.05)

Energies are in the unit of the run's target (eV for data imported with ``data.source=ase``),
forces are ``-dE/dpos`` by autograd in that unit per Angstrom. The model runs in float64 by
default, so energies are smooth enough for finite differences and long trajectories.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ase.calculators.calculator import Calculator, all_changes

from schnet_ipu.data.ase_files import check_frame
from schnet_ipu.inference import Predictor


class SchNetCalculator(Calculator):
    """``energy``, ``free_energy`` (the same) and ``forces`` of one open (non-periodic)
    ``Atoms`` from the run's ``checkpoint`` ("best" or "last") weights."""

    implemented_properties = ("energy", "free_energy", "forces")

    def __init__(
        self,
        run_dir: str | Path,
        checkpoint: str = "best",
        dtype: torch.dtype = torch.float64,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.predictor = Predictor(Path(run_dir), checkpoint, dtype)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        structure = check_frame(self.atoms, "SchNetCalculator: atoms")
        [(energy, forces)] = self.predictor.predict([structure])
        self.results = {"energy": energy, "free_energy": energy, "forces": forces}
