"""The tabulated filter's double backward as a Triton kernel (force training).

Force training differentiates the forces, which come out of ``table_conv``'s backward, so
that backward must be differentiable again. :class:`~.triton_ops._TableConvBackward` runs it
as :func:`~.triton_kernels.fused_conv_backward` and differentiates it here, in one more pass
over the filter rows that, like the others, never writes an [E, F] tensor.

For filter row r (a pair, or an edge) of length d with knot k and position t (see
:func:`~.triton_ops.table_conv`), write W, W' and W'' for the interpolated filter [F] and its
first and second derivatives in d (the cubic's own, in the interval: exact for the
interpolant; W' = (d00 (v_k - v_{k+1}) + d10 h s_k + d11 h s_{k+1}) / h, W'' the same with
e00 = 12t - 6, e10 = 6t - 4, e11 = 6t - 2 over h^2). Given G = d loss / d out, the backward
gives grad_x[src e] += G[dst e] W, grad_dist[r] = sum_f A W' with A = sum_e x[src e] G[dst e]
over the row's edges, and A spread onto knots k and k + 1 with the basis weights (h00, h01 for
the values, h h10, h h11 for the slopes). The double backward is handed U_x [N, F], U_v and
U_s [K, F] and u_d [R], the gradients of a loss on those four outputs, and differentiates

    L = sum_r sum_e sum_f G[dst e] (U_x[src e] W + x[src e] B),
    B = u_d W' + Wu  (the filter's variation; Wu: the table (U_v, U_s) interpolated at d).

With A_u = sum_e U_x[src e] G[dst e]:

* d L / d G[dst e] += U_x[src e] W + x[src e] B and d L / d x[src e] += G[dst e] B
  (atomic adds, as in the backward);
* d L / d d = sum_f A_u W' + A (u_d W'' + Wu') (one store per row);
* d L / d v_k += h00 A_u + d00 u_d A / h, d L / d v_{k+1} += h01 A_u - d00 u_d A / h,
  d L / d s_k += h h10 A_u + d10 u_d A, d L / d s_{k+1} += h h11 A_u + d11 u_d A (atomic adds).

These are :mod:`.fused_table_loops`' double backward formulas (there in the cubic's power
basis, here in the Hermite basis the kernels read the table in). In force training U_v and U_s
are absent (the table does not lie on the path to the positions): ``UP_TABLE`` is then a
compile-time False and they are never read. The Triton calls follow triton.language's
documentation, as in :mod:`.triton_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from schnet_ipu.model.ops.triton_kernels import (
    hermite_basis,
    interpolate,
    knot_position,
    knot_rows,
    launch,
)


@triton.jit
def table_double_backward_kernel(
    up_x_ptr, up_values_ptr, up_slopes_ptr, up_dist_ptr, grad_ptr, x_ptr, src_ptr, dst_ptr,
    values_ptr, slopes_ptr, dist_ptr, mask_ptr,
    out_grad_ptr, out_x_ptr, out_values_ptr, out_slopes_ptr, out_dist_ptr,
    num_rows, num_features, spacing_ptr, num_knots,
    PAIRED: tl.constexpr, UP_TABLE: tl.constexpr, NEED_GRAD: tl.constexpr,
    NEED_X: tl.constexpr, NEED_TABLE: tl.constexpr, NEED_DIST: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """The module docstring's gradients for this program's rows (and their reversed edges
    when ``PAIRED``): out_grad, out_x, out_values and out_slopes by atomic adds (they start
    at zero), out_dist stored; masked rows add nothing and store zero."""
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    feat = tl.arange(0, BLOCK_F)
    feat_ok = feat < num_features
    dist = tl.load(dist_ptr + rows, mask=row_ok, other=0.0)
    keep = row_ok & (tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0)
    ok = keep[:, None] & feat_ok[None, :]
    spacing = tl.load(spacing_ptr)
    k, t = knot_position(dist, spacing, num_knots)
    basis = hermite_basis(t)
    h00, h10, h01, h11, d00, d10, d11 = basis
    at = k[:, None] * num_features + feat[None, :]
    v0, v1, m0, m1 = knot_rows(values_ptr, slopes_ptr, at, ok, spacing, num_features)
    filt, slope = interpolate(v0, v1, m0, m1, basis, spacing)
    curve = (12.0 * t - 6.0)[:, None] * (v0 - v1) + (6.0 * t - 4.0)[:, None] * m0
    curve = (curve + (6.0 * t - 2.0)[:, None] * m1) / (spacing * spacing)
    up_dist = tl.load(up_dist_ptr + rows, mask=keep, other=0.0)[:, None]
    variation = up_dist * slope  # B
    variation_slope = up_dist * curve  # dB/dd
    if UP_TABLE:  # + Wu and Wu': the upstream table interpolated the same way
        u0, u1, n0, n1 = knot_rows(up_values_ptr, up_slopes_ptr, at, ok, spacing, num_features)
        up_filt, up_slope = interpolate(u0, u1, n0, n1, basis, spacing)
        variation += up_filt
        variation_slope += up_slope
    products = tl.zeros((BLOCK_E, BLOCK_F), dtype=filt.dtype)  # A
    up_products = tl.zeros((BLOCK_E, BLOCK_F), dtype=filt.dtype)  # A_u
    for direction in tl.static_range(2 if PAIRED else 1):
        edges = rows + direction * num_rows
        src = tl.load(src_ptr + edges, mask=keep, other=0)
        dst = tl.load(dst_ptr + edges, mask=keep, other=0)
        sender = src[:, None] * num_features + feat[None, :]
        receiver = dst[:, None] * num_features + feat[None, :]
        grad = tl.load(grad_ptr + receiver, mask=ok, other=0.0)
        x = tl.load(x_ptr + sender, mask=ok, other=0.0)
        up_x = tl.load(up_x_ptr + sender, mask=ok, other=0.0)
        products += x * grad
        up_products += up_x * grad
        if NEED_GRAD:
            tl.atomic_add(out_grad_ptr + receiver, up_x * filt + x * variation, mask=ok)
        if NEED_X:
            tl.atomic_add(out_x_ptr + sender, grad * variation, mask=ok)
    if NEED_DIST:
        total = up_products * slope + products * variation_slope
        tl.store(out_dist_ptr + rows, tl.sum(total, axis=1), mask=row_ok)
    if NEED_TABLE:
        moved = products * up_dist  # u_d A
        rise_weight = d00[:, None] * moved / spacing
        tl.atomic_add(out_values_ptr + at, h00[:, None] * up_products + rise_weight, mask=ok)
        tl.atomic_add(
            out_values_ptr + at + num_features, h01[:, None] * up_products - rise_weight, mask=ok
        )
        scaled = up_products * spacing
        tl.atomic_add(out_slopes_ptr + at, h10[:, None] * scaled + d10[:, None] * moved, mask=ok)
        tl.atomic_add(
            out_slopes_ptr + at + num_features,
            h11[:, None] * scaled + d11[:, None] * moved,
            mask=ok,
        )


# Rows per program: 8, half the other kernels' 16, because this kernel holds about twice
# their live [rows, F] tiles (filter, its two derivatives, the variation, both products and
# the table rows). A register estimate, not a measurement: no GPU has run it yet.
BLOCK_ROWS_DOUBLE = 8


def _outputs(x, values, dist, need_grad, need_x, need_table, need_dist, make):
    """(out_grad, out_x, out_values, out_slopes, out_dist) made by ``make(like)``; an empty
    tensor where none is asked for."""
    wanted = (need_grad, need_x, need_table, need_table, need_dist)
    likes = (x, x, values, values, dist)
    return tuple(make(like) if want else x.new_empty(0) for like, want in zip(likes, wanted))


@torch.library.custom_op("schnet_ipu::fused_table_double_backward", mutates_args=())
def fused_table_double_backward(
    up_x: Tensor, up_values: Tensor, up_slopes: Tensor, up_dist: Tensor, grad: Tensor,
    x: Tensor, edge_index: Tensor, values: Tensor, slopes: Tensor, dist: Tensor, mask: Tensor,
    spacing: Tensor, up_table: bool, need_grad: bool, need_x: bool, need_table: bool,
    need_dist: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(d L / d grad [N, F], d L / d x [N, F], d L / d values, d L / d slopes [K, F],
    d L / d dist [R]) for L = <up_x, grad_x> + <up_values, grad_values> + <up_slopes,
    grad_slopes> + <up_dist, grad_dist> of the table's backward (module docstring); empty
    where ``need_*`` is False. ``up_values`` and ``up_slopes`` are read only if
    ``up_table``."""
    outputs = _outputs(x, values, dist, need_grad, need_x, need_table, need_dist, torch.zeros_like)
    rows = dist.shape[0]
    launch(
        table_double_backward_kernel, rows, x.shape[1],
        up_x.contiguous(), up_values.contiguous(), up_slopes.contiguous(), up_dist.contiguous(),
        grad.contiguous(), x, edge_index[0], edge_index[1], values, slopes, dist, mask,
        *outputs, rows, x.shape[1], spacing, values.shape[0],
        block_rows=BLOCK_ROWS_DOUBLE, PAIRED=edge_index.shape[1] == 2 * rows,
        UP_TABLE=up_table, NEED_GRAD=need_grad, NEED_X=need_x, NEED_TABLE=need_table,
        NEED_DIST=need_dist,
    )  # fmt: skip
    return outputs


@fused_table_double_backward.register_fake
def _fused_table_double_backward_shape(
    up_x, up_values, up_slopes, up_dist, grad, x, edge_index, values, slopes, dist, mask,
    spacing, up_table, need_grad, need_x, need_table, need_dist,
):  # fmt: skip
    return _outputs(x, values, dist, need_grad, need_x, need_table, need_dist, torch.empty_like)
