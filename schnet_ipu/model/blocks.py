"""The layers SchNet is built from, with PyTorch Geometric's names and layout.

* :class:`ShiftedSoftplus` and :class:`GaussianSmearing`: the activation and the distance
  expansion;
* :class:`ExactEdges` / :class:`TabulatedEdges`: what a convolution reads of the edges, for
  the filter network per edge or the tabulated filter;
* :class:`CFConv` and :class:`InteractionBlock`: the continuous-filter convolution and one
  interaction (the residual is added in :class:`~schnet_ipu.model.schnet.SchNet`).

Messages are gathered and summed by the op flavour's primitives (:class:`~.ops.Ops`), by
dense [M, M] pair blocks (:mod:`.dense`) or from a table (:mod:`.filter_table`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import Linear, Sequential

from schnet_ipu.model.dense import dense_conv
from schnet_ipu.model.filter_table import hermite_filter
from schnet_ipu.model.ops import Ops, naive_shifted_softplus


def widen(x: Tensor) -> Tensor:
    """``x`` in fp32 if autocast made it bf16 or fp16; fp32 and fp64 pass unchanged."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def full_precision(x: Tensor) -> AbstractContextManager:
    """A region whose ops run in the dtype of their inputs under autocast, on ``x``'s device
    (a nested ``torch.autocast(enabled=False)``, the documented way to exempt a region); a
    no-op on devices autocast does not know (PopTorch's)."""
    if x.device.type not in ("cpu", "cuda"):
        return nullcontext()
    return torch.autocast(x.device.type, enabled=False)


class ShiftedSoftplus(nn.Module):
    """``softplus(x) - log 2``, stable (the flavour's, default) or naive for the ablation."""

    def __init__(self, ops: Ops, stable: bool = True):
        super().__init__()
        self.ops = ops
        self.stable = stable

    def forward(self, x: Tensor) -> Tensor:
        x = widen(x)  # fp32 under bf16 autocast
        return self.ops.shifted_softplus(x) if self.stable else naive_shifted_softplus(x)


EXPONENT_FLOOR = -40.0


class GaussianSmearing(nn.Module):
    """Expands distances [E] into ``num_gaussians`` Gaussians centred on 0..stop -> [E, G].

    Exponents are floored at ``EXPONENT_FLOOR`` = -40 (values >= 4.2e-18). Far tails would
    otherwise be tiny or denormal numbers, and denormals make CPU arithmetic many times
    slower: not only ``exp`` (about 4x), but every product they enter. With the earlier
    floor of -87 (1.6e-38, float32's smallest normal number) the first linear layer of the
    filter network still made denormals (1e-38 times a weight): that product took 165 us
    instead of 13 us on a [256, 25] table, and the EMT force step with the exact filter was
    15% slower (21.5 against 18.4 ms). Every Gaussian sum has a term above 0.88 (the
    nearest centre is at most half a spacing away), so the floor moves a filter by at most
    G x 4.2e-18 relative within the cutoff: nothing in float32, about float64's own
    rounding.
    """

    def __init__(self, start: float = 0.0, stop: float = 6.0, num_gaussians: int = 25):
        super().__init__()
        offset = torch.linspace(start, stop, num_gaussians)
        self.coeff = -0.5 / (offset[1] - offset[0]).item() ** 2
        self.register_buffer("offset", offset)

    def forward(self, dist: Tensor) -> Tensor:
        exponent = self.coeff * (dist.unsqueeze(-1) - self.offset).square()
        return torch.exp(exponent.clamp_(min=EXPONENT_FLOOR))


class ExactEdges(NamedTuple):
    """Edge features of the exact filter: Gaussians rbf [E', G] and cosine cutoff cut [E']
    (0 on masked edges); any leading shape, e.g. dense [B, M, M]."""

    rbf: Tensor
    cut: Tensor


class TabulatedEdges(NamedTuple):
    """What the tabulated filter reads: edge lengths dist [E'] and edge_mask [E'] (any leading
    shape for dense blocks) and the block's table, values and slopes [K, F] on [0, cutoff]
    (:func:`~.filter_table.filter_tables`)."""

    dist: Tensor
    edge_mask: Tensor
    values: Tensor
    slopes: Tensor
    cutoff: float


class CFConv(nn.Module):
    """Continuous-filter convolution: ``lin2(sum_j lin1(x)_j * W(d_ji))``, with the filter
    ``W = nn(rbf) * cut`` from the block's filter network ``nn`` (PyG's names and layout)."""

    def __init__(
        self, in_channels: int, out_channels: int, num_filters: int, mlp: Sequential, ops: Ops
    ):
        super().__init__()
        self.ops = ops
        self.lin1 = Linear(in_channels, num_filters, bias=False)
        self.lin2 = Linear(num_filters, out_channels)
        self.nn = mlp
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.lin1.weight)
        nn.init.xavier_uniform_(self.lin2.weight)
        self.lin2.bias.data.fill_(0)

    def filter(self, rbf: Tensor, cut: Tensor) -> Tensor:
        """rbf [E, G], cut [E] (cosine cutoff, 0 on masked edges) -> filter [E, F]; any
        leading shape, e.g. [B, M, M] pair blocks."""
        return self.nn(rbf) * cut.unsqueeze(-1)

    def forward(
        self,
        x: Tensor,
        edge_index: Tensor | None,
        edges: ExactEdges | TabulatedEdges,
        knn: int | None,
    ) -> Tensor:
        """Convolve x [N, C_in] over edge_index [2, E] (row 0 source j, row 1 receiver i).

        ``edge_index=None``: dense message passing, edges over the [B, M, M] pair blocks of
        the B packs (see :mod:`schnet_ipu.model.dense`).

        ``edges`` describe E' = E edges, or E' = E / 2 unordered pairs when the graph is
        stored as forward pairs then the same pairs reversed (pair-symmetric filter):
        :class:`ExactEdges` for the filter network per edge, :class:`TabulatedEdges` for the
        table (the flavour's ``table_conv``). ``knn=k`` (exact filter): the receivers are
        sorted with exactly k edges each (the layout of ``knn_graph_packed``), so the sum is a
        reshape and a reduction; otherwise the flavour's ``scatter_sum``, which assumes no
        ordering. -> [N, C_out]
        """
        x = widen(self.lin1(x))  # messages and their sums in fp32 under bf16 autocast
        if isinstance(edges, TabulatedEdges):
            values, slopes = edges.values, edges.slopes
            if edge_index is None:  # dense blocks: interpolate every pair of the block
                dist, mask = edges.dist.reshape(-1), edges.edge_mask.reshape(-1)
                filt = hermite_filter(dist, mask, values, slopes, edges.cutoff)
                return self.lin2(dense_conv(x, filt.view(*edges.dist.shape, -1).to(x.dtype)))
            agg = self.ops.table_conv(
                x, edge_index, edges.dist, edges.edge_mask, values, slopes, edges.cutoff
            )
            return self.lin2(agg)
        filt = self.filter(edges.rbf, edges.cut)  # [E', F]
        if edge_index is None:
            return self.lin2(dense_conv(x, filt))
        if filt.shape[0] < edge_index.shape[1]:  # both directions of a pair share its filter
            return self.lin2(self.ops.pair_symmetric_conv(x, edge_index, filt))
        msg = self.ops.gather(x, edge_index[0]) * filt  # [E, F]
        if knn is None:
            agg = self.ops.scatter_sum(msg, edge_index[1], x.shape[0])
        else:
            agg = msg.view(x.shape[0], knn, -1).sum(1)
        return self.lin2(agg)


class InteractionBlock(nn.Module):
    """One SchNet interaction: CFConv, shifted softplus, linear (the residual is in SchNet)."""

    def __init__(
        self,
        hidden_channels: int,
        num_gaussians: int,
        num_filters: int,
        ops: Ops,
        stable: bool = True,
    ):
        super().__init__()
        self.mlp = Sequential(
            Linear(num_gaussians, num_filters),
            ShiftedSoftplus(ops, stable),
            Linear(num_filters, num_filters),
        )
        self.conv = CFConv(hidden_channels, hidden_channels, num_filters, self.mlp, ops)
        self.act = ShiftedSoftplus(ops, stable)
        self.lin = Linear(hidden_channels, hidden_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.mlp[0].weight)
        self.mlp[0].bias.data.fill_(0)
        nn.init.xavier_uniform_(self.mlp[2].weight)
        self.mlp[2].bias.data.fill_(0)
        self.conv.reset_parameters()
        nn.init.xavier_uniform_(self.lin.weight)
        self.lin.bias.data.fill_(0)

    def forward(
        self,
        h: Tensor,
        edge_index: Tensor | None,
        edges: ExactEdges | TabulatedEdges,
        knn: int | None,
    ) -> Tensor:
        """h [N, H] -> update [N, H]; the other arguments as for :meth:`CFConv.forward`."""
        return self.lin(self.act(self.conv(h, edge_index, edges, knn)))
