"""The ``ipu`` op flavour: the same primitives from ops PopTorch maps to Poplar.

PopTorch traces the forward pass only (PopART differentiates it) and refuses aten ops that
have no handler in ``poptorch/source/popart_canonicalization/*.cpp``. So this flavour uses no
custom autograd functions, no ``index_add_`` (sums are out-of-place ``scatter_add``), no
``logaddexp``, no ``torch.eye`` or integer ``repeat_interleave`` (masks come from
comparisons, repeats from ``expand``), and no in-place op on a view. It runs unchanged on the
CPU, where it is the emulator's flavour. Shapes as in :mod:`schnet_ipu.model.ops`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from schnet_ipu.model.filter_table import hermite_filter
from schnet_ipu.model.ops.common import LOG2, SharedOps, edge_distance


def shifted_softplus(x: Tensor) -> Tensor:
    """``log1p(exp(-|x|)) + max(x, 0) - log 2``, written out; any shape."""
    return torch.log1p(torch.exp(-torch.abs(x))) + torch.clamp_min(x, 0.0) - LOG2


def gather(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x`` [N, F] at ``index`` [E] -> [E, F]."""
    return torch.index_select(x, 0, index)


def scatter_sum(src: Tensor, index: Tensor, dim_size: int) -> Tensor:
    """Rows of ``src`` [E, F] (or [E]) summed by ``index`` [E] into [dim_size, F] (or
    [dim_size]) with an out-of-place ``scatter_add``."""
    out = torch.zeros((dim_size, *src.shape[1:]), dtype=src.dtype, device=src.device)
    if src.dim() > 1:
        index = index.unsqueeze(1).expand(src.shape)
    return torch.scatter_add(out, 0, index, src)


def pair_symmetric_conv(x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
    """x [N, F], edge_index [2, 2P] (forward pairs, then reversed), filt [P, F] -> [N, F]."""
    msg = gather(x, edge_index[0]) * torch.cat([filt, filt], dim=0)
    return scatter_sum(msg, edge_index[1], x.shape[0])


def table_conv(
    x: Tensor,
    edge_index: Tensor,
    dist: Tensor,
    edge_mask: Tensor,
    values: Tensor,
    slopes: Tensor,
    cutoff: float,
) -> Tensor:
    """The tabulated-filter convolution (see the torch flavour's
    :func:`~schnet_ipu.model.ops.torch_ops.table_conv`) from ops PopTorch maps: floor,
    clamp, a cast to an integer index, index_select, arithmetic, where, scatter_add."""
    filt = hermite_filter(dist, edge_mask, values, slopes, cutoff).to(x.dtype)  # [E', F]
    if filt.shape[0] < edge_index.shape[1]:
        filt = torch.cat([filt, filt], dim=0)
    return scatter_sum(gather(x, edge_index[0]) * filt, edge_index[1], x.shape[0])


def knn_graph_packed(
    pos: Tensor, graph: Tensor, node_mask: Tensor, nodes_per_pack: int, k: int, cutoff: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The k nearest neighbours within ``cutoff`` inside each pack (see the torch flavour's
    :func:`~schnet_ipu.model.ops.torch_ops.knn_graph_packed` for the layout it returns)."""
    num_nodes = pos.shape[0]
    if num_nodes % nodes_per_pack:
        raise ValueError(f"{num_nodes} atoms are not a whole number of packs of {nodes_per_pack}")
    num_packs = num_nodes // nodes_per_pack
    # no gradient through the search: PopTorch lowers detach to PopART's Detach
    # (popart_canonicalization/AtenHandlers.gen.cpp, detachHandler); torch.no_grad would do too
    # (docs/user_guide/supported_ops.rst, "Gradient computation control")
    p = pos.detach().reshape(num_packs, nodes_per_pack, 3)
    g = graph.reshape(num_packs, nodes_per_pack)
    m = node_mask.reshape(num_packs, nodes_per_pack)
    sq = (p.unsqueeze(2) - p.unsqueeze(1)).square().sum(-1)  # [B, M, M]
    local = torch.arange(nodes_per_pack, device=pos.device)
    allowed = (g.unsqueeze(2) == g.unsqueeze(1)) & m.unsqueeze(2) & m.unsqueeze(1)
    allowed = allowed & (local.unsqueeze(1) != local.unsqueeze(0)) & (sq <= cutoff * cutoff)
    far = 4.0 * cutoff * cutoff + 1.0  # beyond the cutoff: never chosen as a real neighbour
    sq = torch.where(allowed, sq, torch.full_like(sq, far))
    found = min(k, nodes_per_pack)
    best, nearest = torch.topk(sq, found, dim=2, largest=False, sorted=True)  # [B, M, found]
    offset = torch.arange(num_packs, device=pos.device).reshape(num_packs, 1, 1) * nodes_per_pack
    source = (nearest + offset).reshape(num_nodes, found)
    edge_mask = (best <= cutoff * cutoff).reshape(num_nodes, found)
    if found < k:  # packs smaller than k + 1 atoms: fill the rows with masked self loops
        source = torch.cat([source, torch.zeros_like(source[:, : k - found])], dim=1)
        edge_mask = torch.cat([edge_mask, torch.zeros_like(edge_mask[:, : k - found])], dim=1)
    receiver = torch.arange(num_nodes, device=pos.device).unsqueeze(1).expand(num_nodes, k)
    source = torch.where(edge_mask, source, receiver).reshape(-1)
    edge_index = torch.stack([source, receiver.reshape(-1)])
    edge_mask = edge_mask.reshape(-1)
    return edge_index, edge_distance(pos, edge_index, edge_mask, cutoff), edge_mask


class IpuOps(SharedOps):
    """The ipu flavour's primitives (conforms to :class:`~.interface.Ops`)."""

    name = "ipu"
    shifted_softplus = staticmethod(shifted_softplus)
    gather = staticmethod(gather)
    scatter_sum = staticmethod(scatter_sum)
    pair_symmetric_conv = staticmethod(pair_symmetric_conv)
    table_conv = staticmethod(table_conv)
    knn_graph_packed = staticmethod(knn_graph_packed)
