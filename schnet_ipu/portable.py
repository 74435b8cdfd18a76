"""A trained SchNet on one structure of any size, in plain TorchScript-able torch ops.

    module = PortableSchNet.from_trained(load_trained("runs/emt/checkpoints/best.pt"))
    energy, forces = module(z, pos)   # z int64 [N], pos float [N, 3] -> [] float64, [N, 3]

This is the model the ASE calculator, ``predict --input`` and ``train.py export`` run. It
is the trained model's arithmetic (same parameter names, the checkpoint's state dict loads
as it is) with the packing taken away: one structure, its own neighbour search (every pair
within the cutoff, or the k nearest within it for knn models, from the [N, N] distance
matrix: fine up to some thousands of atoms), no padding. It needs nothing of
``schnet_ipu`` at run time, so ``torch.jit.script`` turns it into a file any torch program
loads. The filter network is evaluated exactly (``model.filter=exact``) whatever the run
trained with; a tabulated filter agrees with it within its interpolation error.

Energies are the model's target plus the task's atom references (in float64, so a QM9
total energy keeps its meV); forces are ``-dE/dpos`` by autograd, in ``pos``'s dtype.
Elements the model never saw raise, by number.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Tuple  # typing's forms: TorchScript on Python 3.8

import torch
from torch import Tensor, nn
from torch.nn import Embedding, Linear

if TYPE_CHECKING:
    from schnet_ipu.model_file import TrainedModel

NUM_ELEMENTS = 100  # embedding rows, as the training model (row 0 is its padding atom)


class ShiftedSoftplus(nn.Module):
    """``softplus(x) - log 2`` (torch's softplus: overflow-free; x above 20 passes as x, off
    by under 2e-9)."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.softplus(x) - math.log(2.0)


class DistanceExpansion(nn.Module):
    """Gaussians on 0..cutoff, as the training model's (exponent floored at -87)."""

    def __init__(self, cutoff: float, num_gaussians: int) -> None:
        super().__init__()
        offset = torch.linspace(0.0, cutoff, num_gaussians)
        self.coeff = -0.5 / (offset[1] - offset[0]).item() ** 2
        self.register_buffer("offset", offset)

    def forward(self, dist: Tensor) -> Tensor:
        exponent = self.coeff * (dist.unsqueeze(-1) - self.offset).square()
        return torch.exp(exponent.clamp(min=-87.0))


class Convolution(nn.Module):
    """``lin2(sum_j lin1(h)_j * W_ji)`` over the edges j -> i."""

    def __init__(self, hidden: int, filters: int) -> None:
        super().__init__()
        self.lin1 = Linear(hidden, filters, bias=False)
        self.lin2 = Linear(filters, hidden)

    def forward(
        self, h: Tensor, source: Tensor, receiver: Tensor, filt: Tensor, symmetric: bool
    ) -> Tensor:
        """``symmetric``: each (source, receiver) is an unordered pair whose filter [P, F]
        also carries the message the other way (half the filter work of directed edges)."""
        x = self.lin1(h)
        summed = x.new_zeros(x.shape).index_add(0, receiver, x.index_select(0, source) * filt)
        if symmetric:
            summed = summed.index_add(0, source, x.index_select(0, receiver) * filt)
        return self.lin2(summed)


class Interaction(nn.Module):
    """One interaction block: filter network ``mlp``, convolution, softplus, ``lin``."""

    def __init__(self, hidden: int, gaussians: int, filters: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            Linear(gaussians, filters), ShiftedSoftplus(), Linear(filters, filters)
        )
        self.conv = Convolution(hidden, filters)
        self.act = ShiftedSoftplus()
        self.lin = Linear(hidden, hidden)

    def forward(
        self,
        h: Tensor,
        source: Tensor,
        receiver: Tensor,
        rbf: Tensor,
        cut: Tensor,
        symmetric: bool,
    ) -> Tensor:
        filt = self.mlp(rbf) * cut.unsqueeze(-1)
        return self.lin(self.act(self.conv(h, source, receiver, filt, symmetric)))


class PortableSchNet(nn.Module):
    """``energy, forces = module(z, pos)`` for one structure (see the module docstring).

    Args:
        hidden_channels, num_filters, num_interactions, num_gaussians, cutoff: as trained.
        k: neighbours per atom for a knn model, 0 for a radius model.
        mean_readout: True when the model averages over atoms instead of summing.
        mean, std: per-atom output = h * std + mean.
        atom_reference: [119] per-element energies added to the prediction (float64).
        elements: atomic numbers the model saw in training (anything else raises).
        unit: the energy unit (forces: unit per Angstrom).
    """

    def __init__(
        self,
        hidden_channels: int,
        num_filters: int,
        num_interactions: int,
        num_gaussians: int,
        cutoff: float,
        k: int,
        mean_readout: bool,
        mean: float,
        std: float,
        atom_reference: List[float],
        elements: List[int],
        unit: str,
    ) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.k = k
        self.mean_readout = mean_readout
        self.mean = mean
        self.std = std
        self.atom_reference = atom_reference
        self.unit = unit
        known = torch.zeros(NUM_ELEMENTS + 19, dtype=torch.bool)  # indexed by z up to 118
        known[torch.tensor(elements, dtype=torch.long)] = True
        self.register_buffer("known", known, persistent=False)
        self.embedding = Embedding(NUM_ELEMENTS, hidden_channels, padding_idx=0)
        self.distance_expansion = DistanceExpansion(cutoff, num_gaussians)
        self.interactions = nn.ModuleList(
            [
                Interaction(hidden_channels, num_gaussians, num_filters)
                for _ in range(num_interactions)
            ]
        )
        self.lin1 = Linear(hidden_channels, hidden_channels // 2)
        self.act = ShiftedSoftplus()
        self.lin2 = Linear(hidden_channels // 2, 1)
        self.atomref = Embedding(NUM_ELEMENTS, 1)

    @classmethod
    def from_trained(cls, trained: TrainedModel) -> PortableSchNet:
        """The portable twin of a loaded checkpoint (its weights, float32, eval mode)."""
        spec, arch = trained.spec, trained.spec.model
        module = cls(
            hidden_channels=arch["hidden_channels"],
            num_filters=arch["num_filters"],
            num_interactions=arch["num_interactions"],
            num_gaussians=arch["num_gaussians"],
            cutoff=float(arch["cutoff"]),
            k=int(arch["k"]) if arch["graph"] == "knn" else 0,
            mean_readout=arch["readout"] == "mean",
            mean=spec.mean,
            std=spec.std,
            atom_reference=list(spec.transform.atom_reference),
            elements=list(spec.elements),
            unit=spec.unit,
        )
        state = trained.model.state_dict()
        # conv.nn is the block's mlp again; initial_atomref only seeds training
        kept = {k: v for k, v in state.items() if ".conv.nn." not in k and k != "initial_atomref"}
        module.load_state_dict(kept)
        return module.eval()

    def neighbours(self, pos: Tensor) -> Tuple[Tensor, Tensor]:
        """(source j, receiver i) [E] of every edge, never an atom with itself: for a radius
        model each unordered pair within the cutoff once (j < i; messages go both ways), for
        a knn model the k nearest within the cutoff of every atom."""
        n = pos.shape[0]
        sq = (pos.unsqueeze(1) - pos.unsqueeze(0)).square().sum(-1)  # [N, N], [i, j]
        allowed = (sq <= self.cutoff * self.cutoff) & ~torch.eye(
            n, dtype=torch.bool, device=pos.device
        )
        if self.k == 0:
            pairs = torch.triu(allowed, diagonal=1).nonzero()  # i < j
            return pairs[:, 1], pairs[:, 0]
        found = min(self.k, n - 1)
        best, source = torch.topk(sq.masked_fill(~allowed, math.inf), found, dim=1, largest=False)
        receiver = torch.arange(n, device=pos.device).unsqueeze(1).expand(n, found)
        real = torch.isfinite(best)
        return source[real], receiver[real]

    def check(self, z: Tensor, pos: Tensor) -> None:
        if z.dim() != 1 or pos.dim() != 2 or pos.shape[1] != 3 or pos.shape[0] != z.shape[0]:
            raise ValueError("expected z [N] and pos [N, 3]")
        if z.shape[0] == 0:
            raise ValueError("a structure needs at least one atom")
        if bool((z < 1).any()) or bool((z > 118).any()):
            raise ValueError("atomic numbers must be 1..118")
        unseen = z[~self.known[z]]
        if unseen.shape[0] > 0:
            raise ValueError(f"element {int(unseen[0])} was never seen in training")
        if not bool(torch.isfinite(pos).all()):
            raise ValueError("positions must be finite (NaN or inf found)")

    def forward(self, z: Tensor, pos: Tensor) -> Tuple[Tensor, Tensor]:
        """z int64 [N], pos [N, 3] in Angstrom -> energy [] float64, forces [N, 3]."""
        self.check(z, pos)
        source, receiver = self.neighbours(pos.detach())
        pos = pos.detach().requires_grad_(True)
        dist = (pos.index_select(0, source) - pos.index_select(0, receiver)).square().sum(-1).sqrt()
        rbf = self.distance_expansion(dist)
        cut = 0.5 * (torch.cos(dist * (math.pi / self.cutoff)) + 1.0)
        h = self.embedding(z)
        for interaction in self.interactions:
            h = h + interaction(h, source, receiver, rbf, cut, self.k == 0)
        out = self.lin2(self.act(self.lin1(h))).squeeze(-1) * self.std + self.mean
        out = out + self.atomref(z).squeeze(-1)
        energy = out.mean() if self.mean_readout else out.sum()
        grads = torch.autograd.grad([energy], [pos])
        forces = grads[0]
        assert forces is not None
        numbers: List[int] = z.tolist()
        reference = 0.0  # in Python floats: TorchScript's torch.tensor(list) rounds to float32
        for number in numbers:
            reference += self.atom_reference[number]
        return energy.detach().double() + reference, -forces
