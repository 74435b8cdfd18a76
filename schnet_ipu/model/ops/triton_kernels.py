"""Triton kernels of the ``triton`` op flavour: fused gather-multiply-scatter, both passes.

Imported when the flavour is built (:class:`.triton_ops.TritonOps`), not with the package,
because ``triton.jit`` decides at decoration time whether it compiles for the GPU or runs
under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, the tests), and because the
IPU path (torch 2.0.1, no triton) must import the flavours without it.

One program takes ``BLOCK_E`` rows of the filter (a pair, or an edge without pair-symmetric
storage) and every feature (``BLOCK_F`` = F rounded up to a power of two). It works out the
filter of its rows once, in registers: read from the per-pair filter [P, F], or interpolated
from the table (cubic Hermite, values and slopes [K, F]; see :func:`table_conv` in
:mod:`.triton_ops` for the contract). Then, for each direction of the row (two with
pair-symmetric storage: pair p is edge p and edge p + P), it gathers the sender rows of x,
multiplies, and adds into the receivers with atomic adds, so the [E, F] messages never
reach memory. The backward pass does the same with the incoming gradient and gives
grad x (atomic adds into the senders), grad filter (one store per row, both directions
summed in registers) or, for the table, grad dist (a row sum, one store) and grad
values/slopes (atomic adds into the two knots of each row).

Atomic adds rather than a segment reduction over receiver-sorted edges: they need no
ordering of the edges, and the choice between the two is a GPU measurement still to be made
(see docs/design.md). The Triton language calls follow triton.language's documentation
(``tl.load``/``tl.store`` with masks, ``tl.atomic_add``, ``tl.floor``, ``tl.sum``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def knot_position(dist, spacing, num_knots):
    """(k, t) of lengths ``dist`` [BLOCK_E]: the lower knot k = clamp(floor(d / h), 0, K - 2)
    (int64) and the position t = d / h - k in its interval."""
    s = dist / spacing
    knot = tl.minimum(tl.maximum(tl.floor(s), 0.0), num_knots - 2.0)
    return knot.to(tl.int64), s - knot


@triton.jit
def hermite_basis(t):
    """The four cubic Hermite basis polynomials at t (weights of v_k, h s_k, v_{k+1},
    h s_{k+1}) and the derivatives in t of the first, second and fourth (the third's is minus
    the first's)."""
    t2 = t * t
    t3 = t2 * t
    h00 = 2.0 * t3 - 3.0 * t2 + 1.0
    h10 = t3 - 2.0 * t2 + t
    h01 = -2.0 * t3 + 3.0 * t2
    h11 = t3 - t2
    d00 = 6.0 * t2 - 6.0 * t
    d10 = 3.0 * t2 - 4.0 * t + 1.0
    d11 = 3.0 * t2 - 2.0 * t
    return h00, h10, h01, h11, d00, d10, d11


@triton.jit
def _hermite_filter(
    values_ptr, slopes_ptr, dist, keep, feat, feat_ok, spacing_ptr, num_knots, num_features,
):  # fmt: skip
    """Filter [BLOCK_E, BLOCK_F] at ``dist`` [BLOCK_E] and its derivative in ``dist``, plus
    the table offsets of the lower knots and the four basis weights (for the table's
    gradient). The knot spacing h is read from a one-element tensor of the input dtype, since
    a Python float argument would be float32."""
    spacing = tl.load(spacing_ptr)
    k, t = knot_position(dist, spacing, num_knots)
    basis = hermite_basis(t)
    ok = keep[:, None] & feat_ok[None, :]
    at = k[:, None] * num_features + feat[None, :]
    v0, v1, m0, m1 = knot_rows(values_ptr, slopes_ptr, at, ok, spacing, num_features)
    filt, slope = interpolate(v0, v1, m0, m1, basis, spacing)
    h00, h10, h01, h11, _, _, _ = basis
    return filt, slope, at, h00, h10, h01, h11, spacing


@triton.jit
def knot_rows(values_ptr, slopes_ptr, at, ok, spacing, num_features):
    """A table's rows at the two knots around each length, [BLOCK_E, BLOCK_F] each:
    (v_k, v_{k+1}, h s_k, h s_{k+1}); ``at`` the lower knot's offsets, zeros where not ``ok``."""
    v0 = tl.load(values_ptr + at, mask=ok, other=0.0)
    v1 = tl.load(values_ptr + at + num_features, mask=ok, other=0.0)
    m0 = tl.load(slopes_ptr + at, mask=ok, other=0.0) * spacing
    m1 = tl.load(slopes_ptr + at + num_features, mask=ok, other=0.0) * spacing
    return v0, v1, m0, m1


@triton.jit
def interpolate(v0, v1, m0, m1, basis, spacing):
    """The cubic through :func:`knot_rows` at the rows' positions and its derivative in the
    length: (W, W') [BLOCK_E, BLOCK_F]; ``basis`` from :func:`hermite_basis`."""
    h00, h10, h01, h11, d00, d10, d11 = basis
    filt = h00[:, None] * v0 + h10[:, None] * m0 + h01[:, None] * v1 + h11[:, None] * m1
    slope = (d00[:, None] * (v0 - v1) + d10[:, None] * m0 + d11[:, None] * m1) / spacing
    return filt, slope


@triton.jit
def conv_forward_kernel(
    x_ptr, src_ptr, dst_ptr, filt_ptr, values_ptr, slopes_ptr, dist_ptr, mask_ptr, out_ptr,
    num_rows, num_features, spacing_ptr, num_knots,
    TABLE: tl.constexpr, PAIRED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """out[dst] += x[src] * filter for the rows of this program (and their reversed edges
    when ``PAIRED``). ``out`` must start at zero."""
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    feat = tl.arange(0, BLOCK_F)
    feat_ok = feat < num_features
    if TABLE:
        dist = tl.load(dist_ptr + rows, mask=row_ok, other=0.0)
        keep = row_ok & (tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0)
        filt, _, _, _, _, _, _, _ = _hermite_filter(
            values_ptr, slopes_ptr, dist, keep, feat, feat_ok, spacing_ptr, num_knots, num_features
        )
    else:
        keep = row_ok
        at = rows[:, None] * num_features + feat[None, :]
        filt = tl.load(filt_ptr + at, mask=keep[:, None] & feat_ok[None, :], other=0.0)
    ok = keep[:, None] & feat_ok[None, :]
    for direction in tl.static_range(2 if PAIRED else 1):
        edges = rows + direction * num_rows
        src = tl.load(src_ptr + edges, mask=keep, other=0)
        dst = tl.load(dst_ptr + edges, mask=keep, other=0)
        x = tl.load(x_ptr + src[:, None] * num_features + feat[None, :], mask=ok, other=0.0)
        tl.atomic_add(out_ptr + dst[:, None] * num_features + feat[None, :], x * filt, mask=ok)


@triton.jit
def conv_backward_kernel(
    grad_ptr, x_ptr, src_ptr, dst_ptr, filt_ptr, values_ptr, slopes_ptr, dist_ptr, mask_ptr,
    grad_x_ptr, grad_filt_ptr, grad_values_ptr, grad_slopes_ptr, grad_dist_ptr,
    num_rows, num_features, spacing_ptr, num_knots,
    TABLE: tl.constexpr, PAIRED: tl.constexpr, NEED_X: tl.constexpr, NEED_FILT: tl.constexpr,
    NEED_DIST: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """Gradients of ``conv_forward_kernel`` for this program's rows: grad_x[src] +=
    grad[dst] * filter (atomic; ``grad_x`` starts at zero), and the filter's gradient
    sum over directions of x[src] * grad[dst]: stored per row (exact filter), or through the
    interpolation into grad_dist [rows] (stored) and grad_values / grad_slopes (atomic; they
    start at zero)."""
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    feat = tl.arange(0, BLOCK_F)
    feat_ok = feat < num_features
    if TABLE:
        dist = tl.load(dist_ptr + rows, mask=row_ok, other=0.0)
        keep = row_ok & (tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0)
        filt, slope, at, h00, h10, h01, h11, spacing = _hermite_filter(
            values_ptr, slopes_ptr, dist, keep, feat, feat_ok, spacing_ptr, num_knots, num_features
        )
    else:
        keep = row_ok
        at = rows[:, None] * num_features + feat[None, :]
        filt = tl.load(filt_ptr + at, mask=keep[:, None] & feat_ok[None, :], other=0.0)
    ok = keep[:, None] & feat_ok[None, :]
    grad_filt = tl.zeros((BLOCK_E, BLOCK_F), dtype=filt.dtype)
    for direction in tl.static_range(2 if PAIRED else 1):
        edges = rows + direction * num_rows
        src = tl.load(src_ptr + edges, mask=keep, other=0)
        dst = tl.load(dst_ptr + edges, mask=keep, other=0)
        grad = tl.load(grad_ptr + dst[:, None] * num_features + feat[None, :], mask=ok, other=0.0)
        sender = src[:, None] * num_features + feat[None, :]
        if NEED_X:
            tl.atomic_add(grad_x_ptr + sender, grad * filt, mask=ok)
        if NEED_FILT or NEED_DIST:
            grad_filt += tl.load(x_ptr + sender, mask=ok, other=0.0) * grad
    if TABLE:
        if NEED_DIST:
            tl.store(grad_dist_ptr + rows, tl.sum(grad_filt * slope, axis=1), mask=row_ok)
        if NEED_FILT:
            tl.atomic_add(grad_values_ptr + at, h00[:, None] * grad_filt, mask=ok)
            tl.atomic_add(grad_values_ptr + at + num_features, h01[:, None] * grad_filt, mask=ok)
            scaled = grad_filt * spacing
            tl.atomic_add(grad_slopes_ptr + at, h10[:, None] * scaled, mask=ok)
            tl.atomic_add(grad_slopes_ptr + at + num_features, h11[:, None] * scaled, mask=ok)
    elif NEED_FILT:
        tl.store(grad_filt_ptr + at, grad_filt, mask=ok)


# Filter rows (pairs or edges) per program, every feature in one block: a [4, 128] tile
# (F = 100) is 2 values per thread and tensor at 8 warps. Chosen by the sweeps of
# scripts/gpu_session.py (H200, QM9's paper model, ~1,024 molecules per step, the tf32 fused
# step in its CUDA graph; docs/benchmarks/triton-sweep-h200 and -small, 40 steps per
# setting, one run): 4 x 8 is within 1% of the best of rows {2, 4, 8, 16} x warps
# {4, 8, 16} for both filters, ms per step: exact 5.91 (best 5.85 at 4 x 4; 8 x 8 6.01,
# 16 x 4 7.65), table 4.23 (best 4.20 at 2 x 4; 8 x 8 5.68, 16 x 4 11.9).
BLOCK_ROWS = 4
NUM_WARPS = 8


def launch(
    kernel, rows: int, num_features: int, *args, block_rows: int | None = None, **switches
) -> None:
    """``kernel`` over ``rows`` filter rows, ``block_rows`` per program (``BLOCK_ROWS`` when
    None, read at each launch: a sweep may set it), all features at once."""
    block_rows = block_rows or BLOCK_ROWS
    grid = (triton.cdiv(rows, block_rows),)
    block_features = max(16, 1 << (num_features - 1).bit_length())
    kernel[grid](*args, **switches, BLOCK_E=block_rows, BLOCK_F=block_features,
                 num_warps=NUM_WARPS)  # fmt: skip


# The kernels are wrapped as custom ops (torch.library.custom_op, torch >= 2.4): opaque to
# dynamo and inductor, so ``backend.compile`` keeps one graph around them instead of tracing
# into the launch. Every pointer argument is a tensor; unused ones are given x.


@torch.library.custom_op("schnet_ipu::fused_conv", mutates_args=())
def fused_conv(
    x: Tensor, edge_index: Tensor, filt: Tensor, values: Tensor, slopes: Tensor, dist: Tensor,
    mask: Tensor, spacing: Tensor, rows: int, table: bool,
) -> Tensor:  # fmt: skip
    """out [N, F] = sum over edges of x[src] * filter (see the module docstring)."""
    out = torch.zeros_like(x)
    launch(
        conv_forward_kernel, rows, x.shape[1],
        x, edge_index[0], edge_index[1], filt, values, slopes, dist, mask, out,
        rows, x.shape[1], spacing, values.shape[0],
        TABLE=table, PAIRED=edge_index.shape[1] == 2 * rows,
    )  # fmt: skip
    return out


@fused_conv.register_fake
def _fused_conv_shape(x: Tensor, *args) -> Tensor:
    return torch.empty_like(x)


def _gradient_buffers(x, filt, values, dist, table, need_x, need_filt, need_dist, make):
    """(grad_x, grad_filt, grad_values, grad_slopes, grad_dist) made by ``make(like)``; an
    empty tensor where no gradient is asked for."""
    wanted = (need_x, need_filt and not table, need_filt and table, need_filt and table, need_dist)
    likes = (x, filt, values, values, dist)
    return tuple(make(like) if want else x.new_empty(0) for like, want in zip(likes, wanted))


@torch.library.custom_op("schnet_ipu::fused_conv_backward", mutates_args=())
def fused_conv_backward(
    grad: Tensor, x: Tensor, edge_index: Tensor, filt: Tensor, values: Tensor, slopes: Tensor,
    dist: Tensor, mask: Tensor, spacing: Tensor, rows: int, table: bool, need_x: bool,
    need_filt: bool, need_dist: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(grad_x, grad_filt, grad_values, grad_slopes, grad_dist) of :func:`fused_conv`; empty
    tensors where ``need_*`` is False (values and slopes follow ``need_filt``)."""
    grads = _gradient_buffers(
        x, filt, values, dist, table, need_x, need_filt, need_dist, torch.zeros_like
    )
    launch(
        conv_backward_kernel, rows, x.shape[1],
        grad.contiguous(), x, edge_index[0], edge_index[1], filt, values, slopes, dist, mask,
        *grads, rows, x.shape[1], spacing, values.shape[0],
        TABLE=table, PAIRED=edge_index.shape[1] == 2 * rows,
        NEED_X=need_x, NEED_FILT=need_filt, NEED_DIST=need_dist,
    )  # fmt: skip
    return grads


@fused_conv_backward.register_fake
def _fused_conv_backward_shape(
    grad, x, edge_index, filt, values, slopes, dist, mask, spacing, rows, table, need_x,
    need_filt, need_dist,
):  # fmt: skip
    return _gradient_buffers(
        x, filt, values, dist, table, need_x, need_filt, need_dist, torch.empty_like
    )
