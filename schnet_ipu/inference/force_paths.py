"""One structure's energy, forces and virial by a trained model: one interface, three paths.

    path = force_path(trained, torch.float32)     # once per model: the path its kind needs
    energy, forces, virial = path.energy_forces(Structure(z, pos, cell, pbc, "frame 3"))

:class:`ForcePath` is what :class:`~schnet_ipu.inference.predictor.Predictor` calls; which
implementation a model gets is fixed by how it was trained, and each is kept for its
measured speed (the modules named say how much):

* :class:`DirectPath`: radius models with ``model.filter=table`` where numba is importable:
  :class:`~schnet_ipu.model.direct_forces.DirectTableSchNet`, the table in numba's loops with
  the backward written out (no autograd);
* :class:`EdgeListPath`: other radius models (``exact`` filters, or a table without numba):
  :meth:`PortableSchNet.forward_edges <schnet_ipu.inference.portable.PortableSchNet.forward_edges>`
  over the structure's half list, autograd for the exact filter;
* :class:`KnnPath`: knn-graph models, which search their own neighbours (molecules only).

The training model (:mod:`schnet_ipu.model.schnet` through
:func:`~schnet_ipu.response.energy_response`) does not implement it: it evaluates packed,
padded batches of many structures at fixed shapes (a compiled step's), searching each
pack's graph itself, so one structure's half list is not what it takes.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple  # typing's forms: runtime aliases on Python 3.8

import numpy as np
import torch

try:
    import vesin
except ImportError:  # Python < 3.10 (pyproject.toml installs vesin from 3.10 on)
    vesin = None

from schnet_ipu.config import ConfigError
from schnet_ipu.inference.cell_list import neighbour_pairs
from schnet_ipu.inference.model_file import TrainedModel
from schnet_ipu.inference.portable import PortableSchNet
from schnet_ipu.model.direct_forces import Dense, DirectTableSchNet, TableBlock
from schnet_ipu.model.ops import pair_loops

# Below this many atoms a molecule's pairs come from all N (N - 1) / 2 distances in a
# compiled loop rather than vesin's cell list (see half_list)
MOLECULE_PAIRS_ATOMS = 2000

HalfList = Tuple[np.ndarray, np.ndarray, np.ndarray]  # i, j int64 [P], shift float64 [P, 3]
# energy in the model's unit, forces float64 [N, 3], virial float64 [3, 3] (None: knn paths)
EnergyForces = Tuple[float, np.ndarray, Optional[np.ndarray]]


class Structure:
    """One structure as the paths read it: ``z`` int64 [N], ``pos`` float64 [N, 3] Angstrom
    (contiguous), ``box`` float64 [3, 3] (rows the lattice vectors; zeros for a molecule),
    ``periodic`` (a cell and some True ``pbc``), ``where`` (named in errors), and its half
    lists (:meth:`half_list`), searched once per cutoff on first request: the members of
    an ensemble share them, and a path that searches its own pairs costs none."""

    def __init__(
        self,
        z: np.ndarray,
        pos: np.ndarray,
        cell: np.ndarray | None,
        pbc: np.ndarray | None,
        where: str,
    ) -> None:
        self.periodic = cell is not None and pbc is not None and bool(np.any(pbc))
        self.z = np.asarray(z, dtype=np.int64)
        self.pos = np.ascontiguousarray(pos, dtype=np.float64)
        self.box = np.ascontiguousarray(cell, np.float64) if self.periodic else np.zeros((3, 3))
        self.pbc = pbc
        self.where = where
        self.pairs: dict[float, HalfList] = {}

    def half_list(self, cutoff: float) -> HalfList:
        """The pairs within ``cutoff`` (:func:`half_list`), searched on the first call."""
        if cutoff not in self.pairs:
            self.pairs[cutoff] = half_list(self.pos, self.box, self.pbc, cutoff, self.periodic)
        return self.pairs[cutoff]


class ForcePath(Protocol):
    """A trained model's energy, forces and virial for one structure.

    Implemented by :class:`DirectPath` (table-filter radius models, numba), :class:`EdgeListPath`
    (other radius models, the portable model over the half list) and :class:`KnnPath` (knn
    models, their own search); :func:`force_path` picks one per model. The training model
    (:func:`~schnet_ipu.response.energy_response` on :mod:`schnet_ipu.model.schnet`) is not
    one: it takes packed, padded batches of many structures at fixed shapes and searches each
    pack's graph itself, so one structure's half list is not its input."""

    def energy_forces(self, structure: Structure) -> EnergyForces:
        """(energy in the model's unit with its atom references, forces = -dE/dpos float64
        [N, 3], virial = -dE/dstrain float64 [3, 3] or None where the path has none)."""
        ...


class DirectPath:
    """A table-filter radius model as hand-derived numba loops over the half list."""

    def __init__(self, model: DirectTableSchNet, cutoff: float) -> None:
        self.model, self.cutoff = model, cutoff

    def energy_forces(self, structure: Structure) -> EnergyForces:
        i, j, shift = structure.half_list(self.cutoff)
        return self.model.energy_forces(structure.z, structure.pos, i, j, shift, structure.box)


class EdgeListPath:
    """A radius model's :meth:`PortableSchNet.forward_edges` over the half list."""

    def __init__(self, module: PortableSchNet) -> None:
        self.module = module

    def energy_forces(self, structure: Structure) -> EnergyForces:
        i, j, shift = structure.half_list(self.module.cutoff)
        periodic = structure.periodic
        offsets = shift @ structure.box if periodic else np.zeros((len(i), 3))
        energy, forces, virial = self.module.forward_edges(
            torch.from_numpy(structure.z), torch.from_numpy(structure.pos),
            torch.from_numpy(np.stack([i, j])), torch.from_numpy(offsets), False,
        )  # fmt: skip
        return float(energy), forces.double().numpy(), virial.double().numpy()


class KnnPath:
    """A knn-graph model: its own neighbour search in ``module``'s precision; periodic
    frames are refused (a knn graph has no images)."""

    def __init__(self, module: PortableSchNet, dtype: torch.dtype) -> None:
        self.module, self.dtype = module, dtype

    def energy_forces(self, structure: Structure) -> EnergyForces:
        if structure.periodic:
            raise ConfigError(f"{structure.where}: periodic frames need a radius-graph model")
        pos = torch.from_numpy(structure.pos).to(self.dtype)
        energy, forces = self.module(torch.from_numpy(structure.z), pos)
        return float(energy), forces.double().numpy(), None


def portable_module(trained: TrainedModel, dtype: torch.dtype) -> PortableSchNet:
    """The model as prediction runs it: numba's table loops where they exist, frozen, so
    autograd follows the positions alone and the fused loops skip the gradients of what
    needs none (the table, the first block's input)."""
    return PortableSchNet.from_trained(trained, dtype, fused=True).requires_grad_(False)


def force_path(trained: TrainedModel, dtype: torch.dtype) -> ForcePath:
    """The path for a loaded checkpoint in ``dtype`` (see the module docstring)."""
    module = portable_module(trained, dtype)
    if trained.spec.model["graph"] != "radius":
        return KnnPath(module, dtype)
    if module.fused:
        return DirectPath(direct_model(module), trained.spec.cutoff)
    return EdgeListPath(module)


def half_list(
    pos: np.ndarray, box: np.ndarray, pbc: np.ndarray | None, cutoff: float, periodic: bool
) -> HalfList:
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
