"""A trained SchNet on one structure of any size, in plain TorchScript-able torch ops.

    module = PortableSchNet.from_trained(load_trained("runs/emt/checkpoints/best.pt"))
    energy, forces = module(z, pos)                       # a molecule
    energy, forces, stress = module(z, pos, cell, pbc)    # a periodic (or partly) cell
    energy, forces, virial = module.forward_edges(z, pos, edge_index, offsets, full_list)

This is the model the ASE calculator, ``predict`` and ``train.py export`` run: the trained
model's arithmetic and parameter names with the packing taken away. One structure, no
padding, an O(N) neighbour search of its own in torch ops (:mod:`schnet_ipu.inference.cell_list`:
any pbc, triclinic cells, cells thinner than the cutoff), or the caller's edges
(``forward_edges``, for engines with their own neighbour lists). It needs nothing of
``schnet_ipu`` at run time, so ``torch.jit.script`` turns it into a file any torch program
loads.

Shapes and units (inputs float32 or float64, whatever the module's own precision):
z int [N]; pos [N, 3] Angstrom; cell [3, 3] (rows the lattice vectors); pbc bool [3]
(default all True with a cell) -> energy float64 [] (the model's unit, atom references
included, summed in float64), forces [N, 3] = -dE/dpos and stress [3, 3] = (1/V) dE/deps
(ASE's sign and unit, eV/Angstrom^3; 0 for a zero-volume cell), both in pos's dtype.
``forward_edges`` takes edges i <- j as ``edge_index`` [2, E] (rows i, j) with Cartesian
``offsets`` [E, 3], the edge vector being ``pos[j] - pos[i] + offsets``: every pair once
(``full_list=False``) or both ways (True, LAMMPS's full list); it returns the virial
W = -dE/deps [3, 3] in the energy unit (``stress = -W / V``) instead of the stress.

Derivatives come from one backward pass over the edge vectors r_e: forces are the sums of
dE/dr_e at both ends, and dE/deps = sum_e r_e (x) dE/dr_e (a strain moves every edge
vector alike, images included). For the tabulated filter that pass is written out in
torch ops (:meth:`Interaction.table_backward`, the derivation of
:mod:`schnet_ipu.model.direct_forces`), not autograd's: no graph, no saved [P, F]
tensors, 1.7x less time at 200 atoms; the exact filter goes through autograd.

Filters: a model trained with ``model.filter=table`` reads its cubic Hermite table (the
cubic coefficients [K - 1, 4, F] per block, computed once at build time in float64 from the
filter network: :mod:`schnet_ipu.model.filter_table`); one trained with ``exact`` runs its
filter network per pair. In Python with numba (``fused=True``), the table convolution is
the compiled loop of :mod:`schnet_ipu.model.ops.fused_table` under autograd; the exported
file reads the table in torch ops (same values): one ``embedding_bag`` per chunk of edges
(``TABLE_CHUNK_BYTES``; the cubic's four rows weighted by powers of t, never gathered as
[P, 4, F]), the chunk's gathered node rows written into one workspace per call and
multiplied in place.

Bad input raises ValueError naming it: an element the model never saw (by number), positions
that are not finite or not float32/float64, a cell that is not a finite [3, 3], a pbc without
3 entries. Two atoms at one place give finite forces: their zero-length edge, which has no
direction, adds no force (:func:`edge_lengths`), as in the direct path.

About 560 lines, one file: the whole exported model (blocks, both filter readings and the
table's written-out backward, the three entry points), as PyG's ``schnet.py`` keeps its
model in one file to read top down.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple  # typing's forms: TorchScript, 3.8

import torch
from torch import Tensor, nn
from torch.nn import Embedding, Linear

from schnet_ipu.inference.cell_list import knn_pairs, neighbour_pairs
from schnet_ipu.inference.model_file import TrainedModel
from schnet_ipu.model.blocks import EXPONENT_FLOOR
from schnet_ipu.model.filter_table import filter_tables, hermite_coefficients
from schnet_ipu.model.ops import fused_table
from schnet_ipu.model.schnet import EMBEDDING_ROWS

# Bytes of one [edges, F] tensor per pass of the exact filter's convolution (under autograd):
# at ~0.4 MB they stay in cache and in the allocator's free lists; larger ones are mapped and
# faulted in per op (200-atom molecule, one thread, float32: 14 ms per call at 1,024 edges,
# 18 at 2,048, 39 at 4,096; float64: 33 ms at 512 edges, 90 at 2,048; 1.6 MB: 44 ms against
# 40 on two threads)
CHUNK_BYTES = 400_000
# The same for the table's written-out forward and backward, whose gathered rows reuse one
# workspace per call: there larger chunks pay, fewer ops per edge (float32, two threads, ms
# per call at 0.4 / 1.6 / 3.2 MB: 200-atom molecule 10.3 / 7.7 / 9.2, 1,000 Cu 14.6 / 12.2 /
# 13.1, 10,000 Cu 137 / 116 / 117)
TABLE_CHUNK_BYTES = 1_600_000


def edge_lengths(vec: Tensor) -> Tensor:
    """|vec| [P] of edge vectors [P, 3] whose gradient is 0 at zero length (two atoms at one
    place: no direction, no force, as in the direct path) where sqrt's would be infinite and
    make the forces NaN; elsewhere the values and gradients of ``vec.square().sum(-1).sqrt()``
    bit for bit."""
    squared = vec.square().sum(-1)
    apart = squared > 0
    root = torch.where(apart, squared, torch.ones_like(squared)).sqrt()
    return torch.where(apart, root, torch.zeros_like(squared))


def check_cell(cell: Tensor, pbc: Optional[Tensor]) -> None:
    """Refuse by name a cell that is not a finite [3, 3], and a pbc without 3 entries."""
    if cell.dim() != 2 or cell.shape[0] != 3 or cell.shape[1] != 3:
        raise ValueError("cell must be [3, 3] (rows the lattice vectors)")
    if not bool(torch.isfinite(cell).all()):
        raise ValueError("cell must be finite (NaN or inf found)")
    if pbc is not None and (pbc.dim() != 1 or pbc.shape[0] != 3):
        raise ValueError("pbc must have 3 entries (one per lattice vector)")


class ShiftedSoftplus(nn.Module):
    """``softplus(x) - log 2`` (torch's softplus: overflow-free; x above 20 passes as x, off
    by under 2e-9)."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.softplus(x) - math.log(2.0)


class DistanceExpansion(nn.Module):
    """Gaussians on 0..cutoff, as the training model's (exponent floored at
    ``EXPONENT_FLOOR``)."""

    def __init__(self, cutoff: float, num_gaussians: int) -> None:
        super().__init__()
        offset = torch.linspace(0.0, cutoff, num_gaussians)
        self.coeff = -0.5 / (offset[1] - offset[0]).item() ** 2
        self.floor = EXPONENT_FLOOR  # an attribute: TorchScript reads no module globals
        self.register_buffer("offset", offset)

    def forward(self, dist: Tensor) -> Tensor:
        exponent = self.coeff * (dist.unsqueeze(-1) - self.offset).square()
        return torch.exp(exponent.clamp(min=self.floor))


class Convolution(nn.Module):
    """``lin1`` and ``lin2`` of ``lin2(sum_j lin1(h)_j * W_ji)`` (the trained names)."""

    def __init__(self, hidden: int, filters: int) -> None:
        super().__init__()
        self.lin1 = Linear(hidden, filters, bias=False)
        self.lin2 = Linear(filters, hidden)


def message_add(
    summed: Tensor, x: Tensor, source: Tensor, receiver: Tensor, filt: Tensor, symmetric: bool
) -> Tensor:
    """Adds ``x[j] * filt[e]`` over edges j -> i into ``summed`` [N, F] (in place);
    ``symmetric``: each (source, receiver) is an unordered pair whose filter [P, F] also
    carries the message back."""
    summed.index_add_(0, receiver, x.index_select(0, source) * filt)
    if symmetric:
        summed.index_add_(0, source, x.index_select(0, receiver) * filt)
    return summed


def cubic_rows(table: Tensor, rows: Tensor, weights: Tensor) -> Tensor:
    """``sum_p weights[e, p] table[rows[e, p]]`` [P, F]: a cubic (or its slope) of each edge
    from the table's rows [R, F] as one ``embedding_bag``."""
    return nn.functional.embedding_bag(rows, table, per_sample_weights=weights, mode="sum")


class Interaction(nn.Module):
    """One interaction block: filter network ``mlp`` (or its table), convolution, softplus,
    ``lin``. ``coefficients`` [K - 1, 4, F]: the tabulated filter's cubics, [0, 4, F] for
    the exact filter."""

    def __init__(self, hidden: int, gaussians: int, filters: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            Linear(gaussians, filters), ShiftedSoftplus(), Linear(filters, filters)
        )
        self.conv = Convolution(hidden, filters)
        self.act = ShiftedSoftplus()
        self.lin = Linear(hidden, hidden)
        self.register_buffer("coefficients", torch.zeros(0, 4, filters), persistent=False)
        # d/dt of the cubics: c1, 2 c2, 3 c3 [K - 1, 3, F], read with weights 1, t, t^2
        self.register_buffer("slope_coefficients", torch.zeros(0, 3, filters), persistent=False)
        self.edge_chunk = CHUNK_BYTES // (4 * filters)  # from_trained sets it per dtype

    def forward(
        self,
        h: Tensor,
        source: Tensor,
        receiver: Tensor,
        rbf: Tensor,
        cut: Tensor,
        interval: Tensor,
        t: Tensor,
        symmetric: bool,
        directed: Tensor,
    ) -> Tensor:
        """h [N, H] -> update [N, H] over P edges (source, receiver [P]) under autograd: the
        exact filter reads rbf [P, G] and cut [P]; the fused table loop (``directed`` [2, E],
        built once per call) the interval [P] and position t [P]."""
        x = self.conv.lin1(h)
        if self.coefficients.shape[0] > 0:
            summed = self.fused_sum(x, directed, interval, t)
        else:
            summed = torch.zeros_like(x)
            for start in range(0, source.shape[0], self.edge_chunk):
                end = start + self.edge_chunk
                filt = self.mlp(rbf[start:end]) * cut[start:end].unsqueeze(-1)
                message_add(summed, x, source[start:end], receiver[start:end], filt, symmetric)
        return self.lin(self.act(self.conv.lin2(summed)))

    def table_forward(
        self, h: Tensor, source: Tensor, receiver: Tensor, rows: Tensor, powers: Tensor,
        symmetric: bool, workspace: Tensor,
    ) -> Tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The tabulated block without autograd: (update [N, H], x [N, F], y [N, H]), x and y
        kept for :meth:`table_backward`. rows [P, 4] = 4 interval + 0..3, powers [P, 4] =
        1, t, t^2, t^3: each edge's filter is one ``embedding_bag`` of the cubics' rows
        (no [P, 4, F] gather). ``workspace`` [4, chunk, F]: the rows gathered per chunk of
        edges land there (see :meth:`PortableSchNet.table_energy`)."""
        x = self.conv.lin1(h)
        summed = torch.zeros_like(x)
        table = self.coefficients.view(-1, self.coefficients.shape[2])  # [4 (K - 1), F]
        for start in range(0, source.shape[0], workspace.shape[1]):
            end = min(start + workspace.shape[1], source.shape[0])
            filt = cubic_rows(table, rows[start:end], powers[start:end])
            j, i = source[start:end], receiver[start:end]
            gathered = workspace[0, : end - start]
            # the aten op by name: importing torch_geometric replaces torch.index_select with
            # a Python function (its hash_tensor.py) that TorchScript cannot compile
            torch.ops.aten.index_select(x, 0, j, out=gathered)
            summed.index_add_(0, i, gathered.mul_(filt))
            if symmetric:
                torch.ops.aten.index_select(x, 0, i, out=gathered)
                summed.index_add_(0, j, gathered.mul_(filt))
        y = self.conv.lin2(summed)
        return self.lin(self.act(y)), x, y

    def table_backward(
        self, grad_h: Tensor, x: Tensor, y: Tensor, source: Tensor, receiver: Tensor,
        rows: Tensor, slope_rows: Tensor, powers: Tensor, grad_t: Tensor, symmetric: bool,
        input_grad: bool, workspace: Tensor,
    ) -> Tensor:  # fmt: skip
        """The block's backward written out: adds dE/dt of every edge into ``grad_t`` [P]
        (in place) and returns dE/dh [N, H] at the block's input given ``grad_h`` at its
        output (``input_grad`` False: the residual part alone, for the first block).
        slope_rows [P, 3] = 3 interval + 0..2: the rows of ``slope_coefficients``.

        ``g = dE/dsummed``; edge i <- j with filter W: dE/dW = g_i x_j (+ g_j x_i when the
        pair carries both messages), dE/dt = dE/dW . dW/dt, dE/dx_j += g_i W."""
        grad_y = torch.sigmoid(y) * torch.mm(grad_h, self.lin.weight)  # ssp' = sigmoid
        grad_summed = torch.mm(grad_y, self.conv.lin2.weight)  # [N, F]
        grad_x = torch.zeros_like(x)
        table = self.coefficients.view(-1, self.coefficients.shape[2])
        slopes = self.slope_coefficients.view(-1, self.slope_coefficients.shape[2])
        for start in range(0, source.shape[0], workspace.shape[1]):
            end = min(start + workspace.shape[1], source.shape[0])
            i, j = receiver[start:end], source[start:end]
            g_i, g_j, x_i, to_filter = workspace[:, : end - start].unbind(0)
            torch.ops.aten.index_select(grad_summed, 0, i, out=g_i)
            torch.ops.aten.index_select(x, 0, j, out=to_filter)
            to_filter.mul_(g_i)  # dE/dW [chunk, F]
            if symmetric:
                torch.ops.aten.index_select(grad_summed, 0, j, out=g_j)
                torch.ops.aten.index_select(x, 0, i, out=x_i)
                to_filter.addcmul_(g_j, x_i)
            else:
                g_j = g_i
            slope = cubic_rows(slopes, slope_rows[start:end], powers[start:end, :3])
            grad_t[start:end] += to_filter.mul_(slope).sum(1)
            if input_grad:
                filt = cubic_rows(table, rows[start:end], powers[start:end])
                grad_x.index_add_(0, j, g_i.mul_(filt))
                if symmetric:
                    grad_x.index_add_(0, i, g_j.mul_(filt))
        if input_grad:
            return grad_h + torch.mm(grad_x, self.conv.lin1.weight)
        return grad_h

    def fused_sum(self, x: Tensor, directed: Tensor, interval: Tensor, t: Tensor) -> Tensor:
        """The table convolution as one compiled loop: :class:`FusedTableInteraction` only."""
        raise RuntimeError("the fused table loop runs in FusedTableInteraction only")


class FusedTableInteraction(Interaction):
    """The block with its table convolution as numba's compiled loop
    (:mod:`schnet_ipu.model.ops.fused_table`): Python only, never in an exported file."""

    def fused_sum(self, x: Tensor, directed: Tensor, interval: Tensor, t: Tensor) -> Tensor:
        mask = torch.ones(interval.shape[0], dtype=torch.bool)
        return fused_table.fused_table_conv(x, directed, self.coefficients, interval, t, mask)


class PortableSchNet(nn.Module):
    """See the module docstring. Build with :meth:`from_trained` (weights, table, dtype).

    Args:
        hidden_channels, num_filters, num_interactions, num_gaussians, cutoff: as trained.
        k: neighbours per atom for a knn model (molecules only), 0 for a radius model.
        mean_readout: True when the model averages over atoms instead of summing.
        mean, std: per-atom output = h * std + mean.
        atom_reference: [119] per-element energies added to the prediction (float64).
        elements: atomic numbers the model saw in training (anything else raises).
        unit: the energy unit (forces: unit per Angstrom).
        filter_points: K of a tabulated filter, 0 for the exact filter.
        fused: blocks with numba's table loop (:class:`FusedTableInteraction`; not
            scriptable: for Python callers, never for export).
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
        filter_points: int = 0,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.k = k
        self.mean_readout = mean_readout
        self.mean = mean
        self.std = std
        # float64 [119] (set again after any dtype change: see from_trained); TorchScript's
        # torch.tensor(list of floats) rounds through float32, so it is built here
        self.register_buffer(
            "atom_reference", torch.tensor(atom_reference, dtype=torch.float64), persistent=False
        )
        self.unit = unit
        self.filter_points = filter_points
        self.num_filters = num_filters
        self.chunk_bytes = TABLE_CHUNK_BYTES  # an attribute: TorchScript reads no globals
        known = torch.zeros(len(atom_reference), dtype=torch.bool)  # [119], indexed by z
        known[torch.tensor(elements, dtype=torch.long)] = True
        self.register_buffer("known", known, persistent=False)
        self.embedding = Embedding(EMBEDDING_ROWS, hidden_channels, padding_idx=0)
        self.distance_expansion = DistanceExpansion(cutoff, num_gaussians)
        self.fused = fused
        block = FusedTableInteraction if fused else Interaction
        self.interactions = nn.ModuleList(
            [block(hidden_channels, num_gaussians, num_filters) for _ in range(num_interactions)]
        )
        self.lin1 = Linear(hidden_channels, hidden_channels // 2)
        self.act = ShiftedSoftplus()
        self.lin2 = Linear(hidden_channels // 2, 1)
        self.atomref = Embedding(EMBEDDING_ROWS, 1)

    @classmethod
    def from_trained(
        cls, trained: TrainedModel, dtype: torch.dtype = torch.float32, fused: bool = False
    ) -> PortableSchNet:
        """The portable twin of a loaded checkpoint in ``dtype`` (eval mode, parameters
        frozen): its weights, and for a tabulated filter the table computed in float64.
        ``fused``: the table convolution as numba's loop when numba is importable (not for
        export)."""
        spec, arch = trained.spec, trained.spec.model
        points = int(arch["filter_points"]) if arch.get("filter") == "table" else 0
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
            atom_reference=[float(v) for v in spec.transform.atom_reference],
            elements=list(spec.elements),
            unit=spec.unit,
            filter_points=points,
            fused=bool(fused and points and fused_table.AVAILABLE),
        )
        state = trained.model.state_dict()
        # conv.nn is the block's mlp again; initial_atomref only seeds training
        kept = {k: v for k, v in state.items() if ".conv.nn." not in k and k != "initial_atomref"}
        module.load_state_dict(kept)
        module = module.double()
        if points:
            blocks = list(module.interactions)
            mlps = [block.mlp for block in blocks]
            with torch.no_grad():
                tables = filter_tables(mlps, module.distance_expansion, module.cutoff, points)
                for block, values, slopes in zip(blocks, *tables):
                    cubics = hermite_coefficients(values, slopes, module.cutoff)
                    block.coefficients = cubics
                    orders = torch.tensor([1.0, 2.0, 3.0], dtype=cubics.dtype).view(1, 3, 1)
                    block.slope_coefficients = cubics[:, 1:] * orders
        module = module.to(dtype).eval().requires_grad_(False)  # inference: no weight gradients
        item_bytes = torch.finfo(dtype).bits // 8
        for block in module.interactions:  # an attribute: TorchScript reads no module globals
            block.edge_chunk = CHUNK_BYTES // (item_bytes * arch["num_filters"])
        reference = torch.tensor(spec.transform.atom_reference, dtype=torch.float64)
        module.atom_reference = reference  # .to(dtype) rounded it: float64 again
        return module

    def check(self, z: Tensor, pos: Tensor) -> None:
        if z.dim() != 1 or pos.dim() != 2 or pos.shape[1] != 3 or pos.shape[0] != z.shape[0]:
            raise ValueError("expected z [N] and pos [N, 3]")
        if pos.dtype != torch.float32 and pos.dtype != torch.float64:
            raise ValueError("pos must be float32 or float64 (Angstrom)")
        if z.shape[0] == 0:
            raise ValueError("a structure needs at least one atom")
        if bool((z < 1).any()) or bool((z > 118).any()):
            raise ValueError("atomic numbers must be 1..118")
        unseen = z[~self.known[z]]
        if unseen.shape[0] > 0:
            raise ValueError(f"element {int(unseen[0])} was never seen in training")
        if not bool(torch.isfinite(pos).all()):
            raise ValueError("positions must be finite (NaN or inf found)")

    def forward(
        self, z: Tensor, pos: Tensor, cell: Optional[Tensor] = None, pbc: Optional[Tensor] = None
    ) -> List[Tensor]:
        """[energy, forces] of a molecule, [energy, forces, stress] with a cell (see the
        module docstring for shapes and units)."""
        z = z.long()
        self.check(z, pos)
        if cell is not None:
            check_cell(cell, pbc)
        if pbc is not None:
            pbc = pbc.to(torch.bool)
        dtype = self.embedding.weight.dtype
        own = pos.detach().to(dtype)
        if self.k > 0:
            if cell is not None and (pbc is None or bool(pbc.any())):
                raise ValueError("a knn model takes molecules only: give no cell")
            receiver, source = knn_pairs(own, self.cutoff, self.k)
            offsets = own.new_zeros((receiver.shape[0], 3))
            energy, forces, virial = self.evaluate(z, own, receiver, source, offsets, False)
        else:
            own_cell = None if cell is None else cell.detach().to(dtype)
            receiver, source, shift = neighbour_pairs(own, own_cell, pbc, self.cutoff)
            offsets = shift if own_cell is None else shift @ own_cell
            energy, forces, virial = self.evaluate(z, own, receiver, source, offsets, True)
        if cell is None:
            return [energy, forces.to(pos.dtype)]
        volume = float(torch.linalg.det(cell.detach().double()).abs())
        stress = -virial / volume if volume > 0 else torch.zeros_like(virial)
        return [energy, forces.to(pos.dtype), stress.to(pos.dtype)]

    @torch.jit.export
    def forward_edges(
        self, z: Tensor, pos: Tensor, edge_index: Tensor, offsets: Tensor, full_list: bool
    ) -> List[Tensor]:
        """[energy, forces, virial] over the caller's edges (see the module docstring)."""
        z = z.long()
        self.check(z, pos)
        if self.k > 0:
            raise ValueError("a knn model searches its own neighbours: call model(z, pos)")
        dtype = self.embedding.weight.dtype
        receiver, source = edge_index[0].long(), edge_index[1].long()
        own = pos.detach().to(dtype)
        energy, forces, virial = self.evaluate(
            z, own, receiver, source, offsets.detach().to(dtype), not full_list
        )
        return [energy, forces.to(pos.dtype), virial.to(pos.dtype)]

    def evaluate(
        self,
        z: Tensor,
        pos: Tensor,
        receiver: Tensor,
        source: Tensor,
        offsets: Tensor,
        symmetric: bool,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """(energy float64 [], forces [N, 3], virial [3, 3]) over P edges: receiver, source
        [P], offsets [P, 3] (edge vector ``pos[source] - pos[receiver] + offsets``)."""
        vec = (pos.index_select(0, source) - pos.index_select(0, receiver) + offsets).detach()
        if self.filter_points > 0 and not self.fused:
            energy, grad = self.table_energy(z, vec, receiver, source, symmetric)
        else:
            vec.requires_grad_(True)  # [P, 3]: the one leaf of the backward
            energy = self.energy(z, vec, receiver, source, symmetric)
            grad = torch.zeros_like(vec)  # no pair within the cutoff: the atoms' own energy
            if energy.requires_grad:  # (the weights are frozen: only pairs make it need one)
                grads = torch.autograd.grad([energy], [vec], allow_unused=True)
                found = grads[0]
                if found is not None:
                    grad = found
        forces = torch.zeros_like(pos).index_add_(0, receiver, grad).index_add_(0, source, -grad)
        dE_deps = vec.detach().t() @ grad  # sum over edges of r (x) dE/dr
        virial = -0.5 * (dE_deps + dE_deps.t())
        reference = self.atom_reference.index_select(0, z).sum()
        return energy.detach() + reference, forces, virial

    def table_energy(
        self, z: Tensor, vec: Tensor, receiver: Tensor, source: Tensor, symmetric: bool
    ) -> Tuple[Tensor, Tensor]:
        """(energy float64 [] without atom references, dE/dvec [P, 3]) of a tabulated model
        with the backward written out (no autograd graph: 1.7x faster than autograd's at
        200 atoms): each block keeps its filter input x and pre-activation y, and the
        backward walks the blocks in reverse, summing every edge's dE/dt."""
        with torch.no_grad():
            dist = vec.square().sum(-1).sqrt()  # [P]
            interval, t = self.grid_position(dist)
            powers = torch.stack([torch.ones_like(t), t, t * t, t * t * t], 1)  # [P, 4]
            rows = (4 * interval).unsqueeze(1) + torch.arange(4, device=vec.device)  # [P, 4]
            slope_rows = (3 * interval).unsqueeze(1) + torch.arange(3, device=vec.device)
            h = self.embedding(z)
            # one [4, chunk, F] allocation per call for every chunk's gathered rows: per-chunk
            # temporaries, freed together, made malloc return and re-fault memory (200-atom
            # molecule at 0.4 MB chunks: 10-17 ms per call from one process to the next)
            chunk = self.chunk_bytes // (vec.element_size() * self.num_filters)
            rows_needed = max(min(chunk, vec.shape[0]), 1)  # 1: a loop step, with no pairs
            workspace = vec.new_empty((4, rows_needed, self.num_filters))
            kept: List[Tuple[Tensor, Tensor]] = []
            for interaction in self.interactions:
                update, x, y = interaction.table_forward(
                    h, source, receiver, rows, powers, symmetric, workspace
                )
                h = h + update
                kept.append((x, y))
            q = self.lin1(h)  # [N, H / 2]
            out = self.lin2(self.act(q)).squeeze(-1).double() * self.std + self.mean
            out = out + self.atomref(z).squeeze(-1).double()
            energy = out.mean() if self.mean_readout else out.sum()
            d_out = self.std / z.shape[0] if self.mean_readout else self.std
            grad_h = torch.mm(torch.sigmoid(q) * (self.lin2.weight * d_out), self.lin1.weight)
            grad_t = torch.zeros_like(t)
            for number in range(len(kept) - 1, -1, -1):
                x, y = kept[number]
                for block_number, block in enumerate(self.interactions):
                    if block_number == number:  # TorchScript indexes a ModuleList by literals
                        grad_h = block.table_backward(
                            grad_h, x, y, source, receiver, rows, slope_rows, powers, grad_t,
                            symmetric, number > 0, workspace,
                        )  # fmt: skip
            dt_ddist = (self.filter_points - 1) / self.cutoff
            # an edge of zero length (two atoms at one place) has no direction: it adds no
            # force, as in the direct path (pair_loops.pair_forces), not 0 / 0
            apart = torch.where(dist > 0, dist, torch.ones_like(dist))
            grad = (grad_t * dt_ddist / apart).unsqueeze(1) * vec
        return energy, grad

    def grid_position(self, dist: Tensor) -> Tuple[Tensor, Tensor]:
        """Interval k [P] (int64) of the table's grid and position t [P] in it of edges of
        length ``dist`` [P]: ``s = d (K - 1) / cutoff``, ``k = clamp(floor(s), 0, K - 2)``,
        ``t = s - k`` (differentiable in dist)."""
        scaled = dist * ((self.filter_points - 1) / self.cutoff)
        interval = torch.clamp(torch.floor(scaled.detach()), 0.0, self.filter_points - 2.0)
        return interval.long(), scaled - interval

    def energy(
        self, z: Tensor, vec: Tensor, receiver: Tensor, source: Tensor, symmetric: bool
    ) -> Tensor:
        """The model's energy float64 [] (no atom references) of edges with vectors vec [P, 3]."""
        dist = edge_lengths(vec)
        empty = dist.new_zeros(0)
        if self.filter_points > 0:
            interval_index, t = self.grid_position(dist)
            rbf, cut = empty, empty
        else:
            rbf = self.distance_expansion(dist)
            cut = 0.5 * (torch.cos(dist * (math.pi / self.cutoff)) + 1.0)
            interval_index, t = torch.zeros(0, dtype=torch.long), empty
        directed = torch.zeros(2, 0, dtype=torch.long)
        if self.fused and symmetric:  # the loop's pair-symmetric layout: P.. 2P-1 reverse 0.. P-1
            directed = torch.stack([torch.cat([source, receiver]), torch.cat([receiver, source])])
        elif self.fused:
            directed = torch.stack([source, receiver])
        h = self.embedding(z)
        for interaction in self.interactions:
            h = h + interaction(
                h, source, receiver, rbf, cut, interval_index, t, symmetric, directed
            )
        # per-atom outputs summed in float64: the mean and atomref terms, large beside a
        # float32 model's resolution, never pass through float32 arithmetic
        out = self.lin2(self.act(self.lin1(h))).squeeze(-1).double() * self.std + self.mean
        out = out + self.atomref(z).squeeze(-1).double()
        return out.mean() if self.mean_readout else out.sum()
