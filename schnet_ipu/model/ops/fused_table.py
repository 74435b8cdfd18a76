"""The tabulated filter's convolution as one compiled CPU loop (numba), forward and backward.

``table_conv`` written in torch ops (:func:`schnet_ipu.model.filter_table.hermite_filter`
followed by gather, multiply and scatter) passes over [E, F] tensors about ten times forward
and twenty times backward. Here one loop per pass walks the edges once: it evaluates each
edge's filter from the cubic coefficients of its grid interval in registers, multiplies the
source row of ``x`` and adds into the receiver row; the backward loop does the same for
``grad_x`` and accumulates the gradients of the coefficients [K - 1, 4, F] and of each edge's
position t. No [E, F] tensor is ever allocated.

The loops run in parallel over slices of the F features (each thread owns its columns of
every output, so scatters need no atomics), one slice per torch thread. Under
``create_graph`` (force training differentiates the forces again) the backward pass is
written in torch ops instead, which autograd differentiates. Compiled on first use (~5 s per
dtype, cached beside this file).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

try:
    import numba
except ImportError:  # the torch ops serve instead
    numba = None

AVAILABLE = numba is not None


def _forward_loop(x, src, dst, coeffs, index, t, mask, num_slices, out):  # pragma: no cover
    """out[dst[e]] += x[src[e]] * W(e) for every edge; ``index``/``t``/``mask`` [P] describe
    P filters, edge e uses filter ``e % P`` (E = P, or E = 2P for pair-symmetric storage).

    Written over row slices with unit-stride inner loops, which numba vectorises (with
    ``fastmath``: 3x faster than indexing [row, f] in the inner loop on the 2-core box)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    width = (num_features + num_slices - 1) // num_slices
    for slice_ in numba.prange(num_slices):
        start, stop = slice_ * width, min(num_features, slice_ * width + width)
        filt = np.empty(stop - start, dtype=x.dtype)
        for p in range(num_filters):
            if not mask[p]:
                continue
            k, tp = index[p], t[p]
            c0, c1 = coeffs[k, 0, start:stop], coeffs[k, 1, start:stop]
            c2, c3 = coeffs[k, 2, start:stop], coeffs[k, 3, start:stop]
            for f in range(stop - start):
                filt[f] = ((c3[f] * tp + c2[f]) * tp + c1[f]) * tp + c0[f]
            for c in range(copies):
                e = p + c * num_filters
                row, source = out[dst[e], start:stop], x[src[e], start:stop]
                for f in range(stop - start):
                    row[f] += source[f] * filt[f]


def _backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, num_slices, grad_x, grad_coeffs, grad_t_parts
):  # pragma: no cover
    """Gradients of :func:`_forward_loop` with respect to x, coeffs and t (``grad_t_parts``
    [num_slices, P]: one partial sum over each slice's features)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    width = (num_features + num_slices - 1) // num_slices
    for slice_ in numba.prange(num_slices):
        start, stop = slice_ * width, min(num_features, slice_ * width + width)
        filt = np.empty(stop - start, dtype=x.dtype)
        grad_filt = np.empty(stop - start, dtype=x.dtype)
        for p in range(num_filters):
            if not mask[p]:
                continue
            k, tp = index[p], t[p]
            c0, c1 = coeffs[k, 0, start:stop], coeffs[k, 1, start:stop]
            c2, c3 = coeffs[k, 2, start:stop], coeffs[k, 3, start:stop]
            for f in range(stop - start):
                filt[f] = ((c3[f] * tp + c2[f]) * tp + c1[f]) * tp + c0[f]
                grad_filt[f] = 0.0
            for c in range(copies):
                e = p + c * num_filters
                source, incoming = x[src[e], start:stop], grad[dst[e], start:stop]
                row = grad_x[src[e], start:stop]
                for f in range(stop - start):
                    grad_filt[f] += source[f] * incoming[f]
                    row[f] += incoming[f] * filt[f]
            g0, g1 = grad_coeffs[k, 0, start:stop], grad_coeffs[k, 1, start:stop]
            g2, g3 = grad_coeffs[k, 2, start:stop], grad_coeffs[k, 3, start:stop]
            tp2 = tp * tp
            slope_sum = 0.0
            for f in range(stop - start):
                g = grad_filt[f]
                g0[f] += g
                g1[f] += g * tp
                g2[f] += g * tp2
                g3[f] += g * tp2 * tp
                slope_sum += g * (c1[f] + 2.0 * c2[f] * tp + 3.0 * c3[f] * tp2)
            grad_t_parts[slice_, p] = slope_sum


if AVAILABLE:
    _compile = numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=True)
    _forward_loop = _compile(_forward_loop)
    _backward_loop = _compile(_backward_loop)


def _array(tensor: Tensor) -> np.ndarray:
    """A contiguous tensor's memory as numpy (no copy when it is contiguous already)."""
    return tensor.detach().contiguous().numpy()


class _FusedTableConv(torch.autograd.Function):
    """See :func:`fused_table_conv`. The backward is the compiled loop, or under
    ``create_graph`` (force training) the same gradients in torch ops autograd differentiates
    again (:func:`_table_conv_backward`)."""

    @staticmethod
    def forward(ctx, x, edge_index, coeffs, index, t, mask):  # type: ignore[override]
        out = torch.zeros_like(x)
        slices = min(torch.get_num_threads(), x.shape[1])
        src, dst = edge_index
        _forward_loop(
            _array(x), _array(src), _array(dst), _array(coeffs), _array(index),
            _array(t), _array(mask), slices, out.numpy(),
        )  # fmt: skip
        ctx.save_for_backward(x, edge_index, coeffs, index, t, mask)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        if torch.is_grad_enabled():
            grads = _table_conv_backward(x, edge_index, coeffs, index, t, mask, grad)
            return grads[0], None, grads[1], None, grads[2], None
        slices = min(torch.get_num_threads(), x.shape[1])
        grad_x, grad_coeffs = torch.zeros_like(x), torch.zeros_like(coeffs)
        grad_t_parts = t.new_zeros((slices, index.shape[0]))
        src, dst = edge_index
        _backward_loop(
            _array(x), _array(grad), _array(src), _array(dst), _array(coeffs),
            _array(index), _array(t), _array(mask), slices,
            grad_x.numpy(), grad_coeffs.numpy(), grad_t_parts.numpy(),
        )  # fmt: skip
        return grad_x, None, grad_coeffs, None, grad_t_parts.sum(0), None


def _table_conv_backward(
    x: Tensor,
    edge_index: Tensor,
    coeffs: Tensor,
    index: Tensor,
    t: Tensor,
    mask: Tensor,
    grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`fused_table_conv` with respect to x [N, F], coeffs
    [K - 1, 4, F] and t [P], in out-of-place torch ops (differentiable: double backward)."""
    src, dst = edge_index
    num_filters = index.shape[0]
    copies = src.shape[0] // num_filters
    c0, c1, c2, c3 = coeffs.index_select(0, index).unbind(1)  # [P, F] each
    tc = t.unsqueeze(-1)
    keep = mask.unsqueeze(-1)
    filt = torch.where(keep, ((c3 * tc + c2) * tc + c1) * tc + c0, 0.0)
    grad_msg = grad.index_select(0, dst)  # [E, F]
    weighted = (grad_msg.view(copies, *filt.shape) * filt).view(grad_msg.shape)
    grad_x = torch.zeros_like(x).index_add(0, src, weighted)
    both = (x.index_select(0, src) * grad_msg).view(copies, *filt.shape).sum(0)
    both = torch.where(keep, both, 0.0)  # [P, F]: d loss / d filter
    powers = torch.stack([both, both * tc, both * tc * tc, both * tc * tc * tc], dim=1)
    grad_coeffs = torch.zeros_like(coeffs).index_add(0, index, powers)
    grad_t = (both * (c1 + 2.0 * c2 * tc + 3.0 * c3 * tc * tc)).sum(-1)
    return grad_x, grad_coeffs, grad_t


def fused_table_conv(
    x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, edge_mask: Tensor
) -> Tensor:
    """``out[i] = sum over edges j -> i of x[j] * W(e)``, W from the cubic ``coeffs``
    [K - 1, 4, F] of interval ``index`` [P] at position ``t`` [P] (see
    :func:`schnet_ipu.model.filter_table.grid_position`); ``edge_mask`` [P] False: no
    message. x [N, F] on the CPU, edge_index [2, E] with E = P or 2P (pair-symmetric: edge
    ``p + P`` is edge p reversed). Returns [N, F] with x's dtype (float32 or float64)."""
    return _FusedTableConv.apply(x, edge_index, coeffs.to(x.dtype), index, t.to(x.dtype), edge_mask)
