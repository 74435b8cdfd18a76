"""The ``torch`` op flavour (CPU, CUDA): the fastest ops torch offers, anything goes.

Fused ``logaddexp`` softplus with a hand-written backward (a polynomial under
``torch.compile``), 1-D ``index_add_`` scatters, a pair-symmetric convolution with in-place
buffers, and the knn graph searched block-diagonally per pack. See
:mod:`schnet_ipu.model.ops` for the interface; shapes use N atoms, E edges, F features, B packs
of M = ``nodes_per_pack`` atoms (N = B * M).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.model.filter_table import grid_position, hermite_filter
from schnet_ipu.model.ops import fused_table
from schnet_ipu.model.ops.common import LOG2, SharedOps, edge_distance
from schnet_ipu.model.ops.common import is_compiling as _is_compiling


class _ShiftedSoftplus(torch.autograd.Function):
    """``log1p(exp(-|x|)) + max(x, 0) - log 2`` with the derivative ``sigmoid(x)``.

    ``torch.logaddexp(x, 0)`` evaluates exactly ``max(x, 0) + log1p(exp(-|x - 0|))`` in one
    fused kernel, so the forward pass is two passes over ``x`` (instead of seven for the
    composed formula) and only ``x`` is kept for the backward pass.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.logaddexp(x, x.new_zeros(())).sub_(LOG2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (forces): out of place, differentiable
            return grad * torch.sigmoid(x)
        return torch.sigmoid(x).mul_(grad)


def _log1p_polynomial(degree: int = 8) -> tuple[float, ...]:
    """Coefficients, highest power first, of q with ``e * q(e) = log1p(e)`` on [0, 1].

    A Chebyshev least-squares fit in float64: the fit is within 2.2e-8 of ``log1p``, and the
    float32 evaluation within 1e-7 (about one float32 rounding step at log 2).
    """
    nodes = 0.5 + 0.5 * np.cos(np.pi * (np.arange(4096) + 0.5) / 4096)
    fit = np.polynomial.Chebyshev.fit(nodes, np.log1p(nodes) / nodes, degree, domain=[0, 1])
    return tuple(float(c) for c in fit.convert(kind=np.polynomial.Polynomial).coef[::-1])


LOG1P_POLYNOMIAL = _log1p_polynomial()


class _ShiftedSoftplusFused(torch.autograd.Function):
    """The same function for ``torch.compile``: one exponential, no logarithm.

    With ``e = exp(-|x|)`` in (0, 1], ``log1p(e)`` is a polynomial in ``e`` and the slope
    ``sigmoid(x)`` is ``1 / (1 + e)`` (x >= 0) or ``e / (1 + e)``. Inductor fuses all of it
    into one vectorised loop; its ``logaddexp`` and ``log1p`` kernels cost about three
    times as much. The slope is kept for the backward pass, which is then one product; it is
    a constant to autograd, so this is differentiable once only (a second derivative raises).
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        e = torch.exp(-x.abs())
        log1p_e = LOG1P_POLYNOMIAL[0]
        for coefficient in LOG1P_POLYNOMIAL[1:]:
            log1p_e = log1p_e * e + coefficient
        slope = torch.where(x >= 0, 1.0, e) / (1.0 + e)
        ctx.save_for_backward(slope)
        return torch.clamp(x, min=0.0) + (log1p_e * e - LOG2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (slope,) = ctx.saved_tensors
        return grad * slope


def shifted_softplus(x: Tensor) -> Tensor:
    """Shifted softplus ``softplus(x) - log 2`` in the overflow-free form
    ``log1p(exp(-|x|)) + max(x, 0) - log 2``: finite for every finite ``x``, no branch.

    Eager execution uses torch's fused ``logaddexp`` kernel; under ``torch.compile`` the
    ``log1p`` is a polynomial that inductor fuses with the exponential (float32 and narrower;
    the two agree to about 1e-7). Shape: any; returns a tensor of the same shape and dtype.
    """
    if _is_compiling() and x.dtype != torch.float64:
        return _ShiftedSoftplusFused.apply(x)
    return _ShiftedSoftplus.apply(x)


def gather(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x`` [N, F] at ``index`` [E] -> [E, F], via ``index_select`` (no ordering
    assumed; its backward is a 1-D ``index_add_``)."""
    return x.index_select(0, index)


def scatter_sum(src: Tensor, index: Tensor, dim_size: int) -> Tensor:
    """Sum the rows of ``src`` [E, F] (or [E]) into ``dim_size`` rows by the 1-D ``index`` [E].

    Uses ``index_add_`` with the 1-D index directly, never an index expanded to the feature
    width, so it allocates only the [dim_size, F] result. It relies on no receiver ordering:
    ``index`` may be unsorted and repeat freely. Its backward is an ``index_select``.
    """
    out = src.new_zeros((dim_size, *src.shape[1:]))
    return out.index_add_(0, index, src)


class _PairSymmetricConv(torch.autograd.Function):
    """Messages over a radius graph stored as forward pairs then the same pairs reversed, both
    directions of a pair weighted by its one filter. See :func:`pair_symmetric_conv`.

    The backward recomputes the gathered features instead of keeping the [E, F] messages, and
    updates its buffers in place: four [E, F] passes fewer than autograd's broadcast form.
    Under ``create_graph`` (force training) it is written in out-of-place differentiable ops
    instead, so autograd can differentiate it again (double backward).
    """

    @staticmethod
    def forward(ctx, x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
        src, dst = edge_index
        msg = x.index_select(0, src)  # [E, F]
        msg.view(2, *filt.shape).mul_(filt)
        ctx.save_for_backward(x, edge_index, filt)
        return x.new_zeros(x.shape).index_add_(0, dst, msg)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, edge_index, filt = ctx.saved_tensors
        src, dst = edge_index
        grad_msg = grad.index_select(0, dst)  # [E, F]
        if torch.is_grad_enabled():
            return _pair_symmetric_conv_backward(x, src, filt, grad_msg, ctx.needs_input_grad)
        grad_x = grad_filt = None
        if ctx.needs_input_grad[2]:
            both = x.index_select(0, src).mul_(grad_msg).view(2, *filt.shape)
            grad_filt = both[0] + both[1]
        if ctx.needs_input_grad[0]:
            grad_msg.view(2, *filt.shape).mul_(filt)
            grad_x = x.new_zeros(x.shape).index_add_(0, src, grad_msg)
        return grad_x, None, grad_filt


def _pair_symmetric_conv_backward(
    x: Tensor, src: Tensor, filt: Tensor, grad_msg: Tensor, needs: tuple[bool, ...]
) -> tuple[Tensor | None, None, Tensor | None]:
    """The backward of :class:`_PairSymmetricConv` in out-of-place ops autograd differentiates:
    x [N, F], src [E], filt [P, F], grad_msg [E, F] -> (grad_x [N, F], None, grad_filt [P, F])."""
    grad_x = grad_filt = None
    if needs[2]:
        grad_filt = (x.index_select(0, src) * grad_msg).view(2, *filt.shape).sum(0)
    if needs[0]:
        weighted = grad_msg.view(2, *filt.shape) * filt
        grad_x = x.new_zeros(x.shape).index_add(0, src, weighted.view(grad_msg.shape))
    return grad_x, None, grad_filt


def pair_symmetric_conv(x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
    """``out[i] = sum over edges (j -> i) of x[j] * filt[pair of the edge]``.

    x [N, F]; edge_index [2, E] with E = 2P: edges P.. 2P-1 are edges 0.. P-1 reversed;
    filt [P, F], one filter per pair, shared by its two directions. Returns [N, F]. Equal to
    ``scatter_sum(gather(x, src) * cat([filt, filt]), dst)``; differentiable twice in x and
    filt (the indices carry no gradient).
    """
    return _PairSymmetricConv.apply(x, edge_index, filt)


def table_conv(
    x: Tensor,
    edge_index: Tensor,
    dist: Tensor,
    edge_mask: Tensor,
    values: Tensor,
    slopes: Tensor,
    cutoff: float,
) -> Tensor:
    """``out[i] = sum over edges (j -> i) of x[j] * W(d_ji)``, W interpolated (cubic Hermite)
    from the table ``values``/``slopes`` [K, F] on [0, cutoff] (see
    :mod:`schnet_ipu.model.filter_table`); masked edges add nothing.

    x [N, F]; edge_index [2, E]; dist and edge_mask [E'] with E' = E, or E' = E / 2 for
    pair-symmetric storage (edges E'.. E-1 are edges 0.. E'-1 reversed and share their
    filter). Returns [N, F]. Differentiable in x, dist, values and slopes.

    On CPU tensors with numba: one compiled loop per pass (:mod:`.fused_table`, twice
    differentiable; custom operators that ``torch.compile`` calls as they are on torch >= 2.4,
    so on older torch only outside ``torch.compile``). Otherwise plain torch ops: the interpolated
    filter [E', F], then :func:`pair_symmetric_conv` or gather-multiply-scatter; these are
    the reference other flavours' kernels are tested against, and on CUDA they run as they
    are (a fused GPU kernel is another flavour's).
    """
    fused_here = fused_table.CUSTOM_OPS or not _is_compiling()
    if fused_table.AVAILABLE and x.device.type == "cpu" and fused_here:
        index, t = grid_position(dist, values.shape[0], cutoff)
        coeffs = fused_table.table_coefficients(values, slopes, cutoff)
        return fused_table.fused_table_conv(x, edge_index, coeffs, index, t, edge_mask)
    return table_conv_unfused(x, edge_index, dist, edge_mask, values, slopes, cutoff)


def table_conv_unfused(
    x: Tensor,
    edge_index: Tensor,
    dist: Tensor,
    edge_mask: Tensor,
    values: Tensor,
    slopes: Tensor,
    cutoff: float,
) -> Tensor:
    """:func:`table_conv` in torch ops alone (any device, differentiable to any order): the
    interpolated filter [E', F], then :func:`pair_symmetric_conv` or gather-multiply-scatter."""
    filt = hermite_filter(dist, edge_mask, values, slopes, cutoff).to(x.dtype)  # [E', F]
    if filt.shape[0] < edge_index.shape[1]:
        return pair_symmetric_conv(x, edge_index, filt)
    return scatter_sum(gather(x, edge_index[0]) * filt, edge_index[1], x.shape[0])


def knn_graph_packed(
    pos: Tensor, graph: Tensor, node_mask: Tensor, nodes_per_pack: int, k: int, cutoff: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The k nearest neighbours within ``cutoff`` of every atom, searched inside its own pack.

    Distances are computed block-diagonally: ``pos`` is viewed as [B, M, 3] and each pack's
    [M, M] distance matrix is searched on its own, so the work is B * M^2 rather than N^2.
    Candidates in another molecule, padding atoms and the atom itself are excluded.

    Args:
        pos: [N, 3] positions, N = B * nodes_per_pack.
        graph: [N] molecule slot of each atom (padding atoms share the filler slot).
        node_mask: [N] True for real atoms.
        nodes_per_pack: M, the atoms of one pack.
        k: neighbours per atom.
        cutoff: neighbours further than this are dropped.

    Returns:
        ``edge_index`` [2, N * k] (row 0 the neighbour j = message source, row 1 the atom i =
        receiver; the receivers are sorted, k consecutive edges per atom), ``dist`` [N * k]
        and ``edge_mask`` [N * k]. Exactly k edges per atom. An edge that is masked (fewer than
        k real neighbours within the cutoff, or a padding atom) is a self loop ``i -> i`` with
        ``dist == cutoff``, so it never joins two molecules and the cosine cutoff zeroes it.
        ``dist`` is differentiable with respect to ``pos``; the search itself is not.
    """
    num_nodes = pos.shape[0]
    if num_nodes % nodes_per_pack:
        raise ValueError(f"{num_nodes} atoms are not a whole number of packs of {nodes_per_pack}")
    num_packs = num_nodes // nodes_per_pack
    receiver = torch.arange(num_nodes, device=pos.device)
    with torch.no_grad():
        p = pos.detach().view(num_packs, nodes_per_pack, 3)
        g = graph.view(num_packs, nodes_per_pack)
        m = node_mask.view(num_packs, nodes_per_pack)
        sq = (p.unsqueeze(2) - p.unsqueeze(1)).square().sum(-1)  # [B, M, M]
        allowed = (g.unsqueeze(2) == g.unsqueeze(1)) & m.unsqueeze(2) & m.unsqueeze(1)
        allowed &= ~torch.eye(nodes_per_pack, dtype=torch.bool, device=pos.device)
        allowed &= sq <= cutoff * cutoff
        sq = sq.masked_fill(~allowed, math.inf)
        found = min(k, nodes_per_pack)
        best, local = torch.topk(sq, found, dim=2, largest=False, sorted=True)  # [B, M, found]
        offset = torch.arange(num_packs, device=pos.device).view(num_packs, 1, 1) * nodes_per_pack
        source = (local + offset).reshape(num_nodes, found)
        edge_mask = torch.isfinite(best).reshape(num_nodes, found)
        if found < k:  # packs smaller than k + 1 atoms: fill the rows with masked self loops
            source = torch.cat([source, source.new_zeros(num_nodes, k - found)], dim=1)
            edge_mask = torch.cat([edge_mask, edge_mask.new_zeros(num_nodes, k - found)], dim=1)
        source = torch.where(edge_mask, source, receiver.unsqueeze(1)).reshape(-1)
        edge_mask = edge_mask.reshape(-1)
        target = receiver.repeat_interleave(k)
    edge_index = torch.stack([source, target])
    dist = edge_distance(pos, edge_index, edge_mask, cutoff)
    return edge_index, dist, edge_mask


class TorchOps(SharedOps):
    """The torch flavour's primitives (conforms to :class:`~.interface.Ops`)."""

    name = "torch"
    shifted_softplus = staticmethod(shifted_softplus)
    gather = staticmethod(gather)
    scatter_sum = staticmethod(scatter_sum)
    pair_symmetric_conv = staticmethod(pair_symmetric_conv)
    table_conv = staticmethod(table_conv)
    knn_graph_packed = staticmethod(knn_graph_packed)
