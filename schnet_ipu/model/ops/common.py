"""Ops shared by every flavour: they use only what both torch and PopTorch run as written.

:class:`SharedOps` holds them for the flavour classes, which add their own primitives.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG2 = math.log(2.0)

# torch.compiler.is_compiling appeared in torch 2.1; torch 2.0 (the Poplar SDK's) has the
# torch._dynamo one.
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
if is_compiling is None:
    import torch._dynamo

    is_compiling = torch._dynamo.is_compiling


def naive_shifted_softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x)) - log 2`` as written, which overflows to ``inf`` for large ``x``
    (``x > 88`` in float32). Only for the ``stable_softplus=False`` ablation.
    """
    return torch.log(1.0 + torch.exp(x)) - LOG2


def edge_distance(
    pos: Tensor,
    edge_index: Tensor,
    edge_mask: Tensor,
    cutoff: float,
    offset: Tensor | None = None,
) -> Tensor:
    """Length [E] of each edge in ``edge_index`` [2, E] over ``pos`` [N, 3]; masked edges read
    ``cutoff``. ``offset`` [E, 3] (periodic edges, :func:`cell_offsets`): the edge is the
    vector ``pos[edge_index[1]] - pos[edge_index[0]] + offset``.

    The square root is taken after masking, so masked (zero-length) edges give no NaN gradient.
    """
    diff = pos.index_select(0, edge_index[0]) - pos.index_select(0, edge_index[1])
    if offset is not None:
        diff = diff - offset
    sq = diff.square().sum(-1)
    return torch.where(edge_mask, sq, cutoff * cutoff).sqrt()  # a scalar: no host copy


def cell_offsets(edge_shift: Tensor, cell: Tensor, graph: Tensor, receiver: Tensor) -> Tensor:
    """``edge_shift[e] @ cell[slot of receiver[e]]`` [E, 3]: the Cartesian offset of each
    periodic edge, from integer shifts [E, 3], cells [G, 3, 3] (rows the lattice vectors),
    each atom's slot ``graph`` [N] in [0, G] (G: padding, which gets a zero cell) and each
    edge's receiving atom [E]. Differentiable in ``cell`` (the stress's strain); gathers,
    products and a sum only, which PopTorch maps."""
    cells = torch.cat([cell, cell.new_zeros((1, 3, 3))])  # [G + 1, 3, 3]
    per_edge = cells.index_select(0, graph.index_select(0, receiver))  # [E, 3, 3]
    return (edge_shift.to(cell.dtype).unsqueeze(-1) * per_edge).sum(1)


class SharedOps:
    """The primitives of :class:`~.interface.Ops` that every flavour takes from here."""

    edge_distance = staticmethod(edge_distance)
    cell_offsets = staticmethod(cell_offsets)
