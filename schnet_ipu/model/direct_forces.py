"""Energy, forces and virial of a trained table-filter SchNet on one structure, with the
backward pass written out by hand instead of autograd: the ASE calculator's and
``predict``'s path for ``model.filter=table`` models
(:class:`schnet_ipu.inference.predictor.Predictor`).

    direct = direct_model(portable_module)  # schnet_ipu.inference.force_paths: frozen weights
    energy, forces, virial = direct.energy_forces(z, pos, i, j, shift, cell)

Why: a small structure's call was mostly overhead, not arithmetic. Through autograd a
20-atom molecule (paper model: H = F = 100, 4 blocks) took ~1.3 ms for energy + forces of
which the table loops were ~0.1 ms; the rest was the dispatch of ~150 tensor ops, the
autograd graph and its engine. Here the forward keeps what the backward needs (each
block's filter input ``x``, its pre-activation ``y``) and the backward is a fixed sequence:
per block two matrix products, a sigmoid and the fused table loop's backward
(:func:`~schnet_ipu.model.ops.fused_table_loops.backward_loop`, called on numpy views,
which returns dE/dt per pair); the per-pair gradients of all blocks are summed and turned
into forces and the strain derivative in one compiled pass over the pairs
(:mod:`~schnet_ipu.model.ops.pair_loops`), with the geometry in float64. The first
block's backward computes dE/dt alone (its input, the embedding, needs no gradient).

FlashSchNet (UNITES-Lab/flash-molecular-dynamics, src/flashmd/kernels/cfconv_kernels.py)
fuses the same gather-multiply-scatter of the convolution and its backward into single GPU
kernels; its half-precision filters were not taken (they change results), nor its
source-sorted backward, which avoids atomic adds that a one-thread CPU loop never needs.

The model, per block (``ssp(y) = softplus(y) - log 2``, pairs with table position t):

    x = h W1^T;  m = conv(x, t);  y = m W2^T + b2;  h <- h + ssp(y) W3^T + b3
    E = sum_atoms ((ssp(h R1^T + r1) R2^T + r2) std + mean + atomref[z])  (or the mean)

and its backward (``sigmoid = ssp'``), from ``g_h = (sigmoid(q) * std R2) R1``:

    g_y = (g_h W3) * sigmoid(y);  (g_x, dE/dt) = conv_backward(g_y W2, x);  g_h += g_x W1

Results equal the autograd path's to float32 rounding (tests/inference/test_calculator_direct.py).
Folding each shifted softplus's ``- log 2`` into the next layer's bias would save an op per
layer but cost digits: the float32 energy of the 20-atom molecule moved 1.4e-6 eV from
float64 instead of 0.6e-6 (main's autograd path: 0.2e-6), so it is not done. Shapes: z [N]
int64, pos [N, 3] float64, pairs i, j [P] int64 (a half list, edge vector
``pos[j] - pos[i] + shift @ cell``), shift [P, 3] float64 or [0, 3] for a molecule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional

from schnet_ipu.model.ops import fused_table_loops, pair_loops

LOG2 = math.log(2.0)


@dataclass(frozen=True)
class Dense:
    """A linear layer ``x W^T + bias`` as the two layouts its passes multiply by:
    ``forward`` = W^T [in, out] and ``backward`` = W [out, in], both contiguous."""

    forward: Tensor
    backward: Tensor
    bias: Tensor | None

    @classmethod
    def of(cls, weight: Tensor, bias: Tensor | None) -> Dense:
        """``weight`` [out, in], ``bias`` [out] or None."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach().contiguous()
        return cls(weight.t().contiguous(), weight.contiguous(), bias)

    def __call__(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return torch.mm(x, self.forward)
        return torch.addmm(self.bias, x, self.forward)


@dataclass(frozen=True)
class TableBlock:
    """One interaction block: ``lin1`` (no bias), the table's cubics ``coefficients``
    [K - 1, 4, F] (numpy), ``lin2`` and ``lin``."""

    lin1: Dense
    coefficients: np.ndarray
    lin2: Dense
    lin: Dense


class DirectTableSchNet:
    """See the module docstring; built from a PortableSchNet by
    :func:`schnet_ipu.inference.force_paths.direct_model`.

    Args:
        embedding: [rows, H] per-element features.
        blocks: the interaction blocks in order.
        readout1: ``lin1`` of the readout (H -> H / 2); readout2: ``lin2`` (H / 2 -> 1).
        atomref: [rows] per-element outputs added to each atom's (float64).
        atom_reference: [rows] the energy references (float64), added after.
        mean, std, mean_readout, cutoff, filter_points: as the trained model.
    """

    def __init__(
        self,
        embedding: Tensor,
        blocks: list[TableBlock],
        readout1: Dense,
        readout2: Dense,
        atomref: np.ndarray,
        atom_reference: np.ndarray,
        mean: float,
        std: float,
        mean_readout: bool,
        cutoff: float,
        filter_points: int,
    ) -> None:
        self.embedding = embedding.detach().contiguous()
        self.blocks = blocks
        self.readout1, self.readout2 = readout1, readout2
        self.atomref, self.atom_reference = atomref, atom_reference
        self.mean, self.std, self.mean_readout = mean, std, mean_readout
        self.scale = (filter_points - 1) / cutoff
        self.last_interval = float(filter_points - 2)
        self.numpy_dtype = self.embedding.numpy().dtype
        self.no_coefficients = np.empty((0, 0, 0), self.numpy_dtype)

    def energy_forces(
        self,
        z: np.ndarray,
        pos: np.ndarray,
        i: np.ndarray,
        j: np.ndarray,
        shift: np.ndarray,
        cell: np.ndarray,
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(energy, forces [N, 3], virial [3, 3] = -dE/deps): energy in the model's unit
        with the atom references, forces and virial float64 (see the module docstring)."""
        if not np.isfinite(pos).all():
            raise ValueError("positions must be finite (NaN or inf found)")
        pairs = i.shape[0]
        vec, dist = np.empty((pairs, 3)), np.empty(pairs)
        interval, t = np.empty(pairs, np.int64), np.empty(pairs, self.numpy_dtype)
        pair_loops.pair_geometry(
            pos, i, j, shift, cell, self.scale, self.last_interval, vec, dist, interval, t
        )
        src, dst = np.concatenate([j, i]), np.concatenate([i, j])  # pair-symmetric: 2P edges
        mask = np.ones(pairs, np.bool_)
        h = self.embedding.index_select(0, torch.from_numpy(z))  # [N, H]
        saved = []
        for block in self.blocks:
            x = block.lin1(h)  # [N, F]
            summed = torch.zeros_like(x)
            fused_table_loops.forward_loop(
                x.numpy(), src, dst, block.coefficients, interval, t, mask, summed.numpy()
            )
            y = block.lin2(summed)  # [N, H]
            h = h + block.lin(functional.softplus(y).sub_(LOG2))
            saved.append((x, y))
        q = self.readout1(h)  # [N, H / 2]
        per_atom = self.readout2(functional.softplus(q).sub_(LOG2))[:, 0].numpy().astype(np.float64)
        out = per_atom * self.std + self.mean + self.atomref[z]
        energy = out.mean() if self.mean_readout else out.sum()
        d_out = self.std / len(z) if self.mean_readout else self.std
        grad_h = torch.mm(
            torch.sigmoid(q).mul_(self.readout2.backward * d_out), self.readout1.backward
        )
        grad_t = np.zeros(pairs, self.numpy_dtype)
        block_grad_t = np.empty(pairs, self.numpy_dtype)
        for number in range(len(self.blocks) - 1, -1, -1):
            block, (x, y) = self.blocks[number], saved[number]
            grad_y = torch.sigmoid(y).mul_(torch.mm(grad_h, block.lin.backward))
            grad_summed = torch.mm(grad_y, block.lin2.backward)  # [N, F]
            if number == 0:  # the first block's input is the embedding: dE/dt alone
                pair_loops.table_slope_sum(
                    x.numpy(), grad_summed.numpy(), i, j, block.coefficients, interval, t, grad_t
                )
                break
            grad_x = torch.zeros_like(x)
            fused_table_loops.backward_loop(
                x.numpy(), grad_summed.numpy(), src, dst, block.coefficients, interval, t,
                mask, False, grad_x.numpy(), self.no_coefficients, block_grad_t,
            )  # fmt: skip
            grad_t += block_grad_t
            grad_h = torch.addmm(grad_h, grad_x, block.lin1.backward)
        forces, dE_deps = np.zeros((len(z), 3)), np.zeros((3, 3))
        pair_loops.pair_forces(i, j, vec, dist, grad_t, self.scale, forces, dE_deps)
        virial = -0.5 * (dE_deps + dE_deps.T)
        return float(energy) + float(self.atom_reference[z].sum()), forces, virial
