"""Triton kernels of the ``triton`` op flavour: fused gather-multiply-scatter, both passes.

Imported only when a kernel first runs (:mod:`.triton_ops` imports it lazily), because
``triton.jit`` decides at decoration time whether it compiles for the GPU or runs under
Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, the tests).

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

import triton
import triton.language as tl


@triton.jit
def _hermite_filter(
    values_ptr, slopes_ptr, dist, keep, feat, feat_ok, spacing_ptr, num_knots, num_features,
):  # fmt: skip
    """Filter [BLOCK_E, BLOCK_F] at ``dist`` [BLOCK_E] and its derivative in ``dist``, plus
    the table offsets of the lower knots and the four basis weights (for the table's
    gradient). The knot spacing h is read from a one-element tensor of the input dtype, since
    a Python float argument would be float32."""
    spacing = tl.load(spacing_ptr)
    s = dist / spacing
    knot = tl.minimum(tl.maximum(tl.floor(s), 0.0), num_knots - 2.0)
    t = s - knot
    k = knot.to(tl.int64)
    t2 = t * t
    t3 = t2 * t
    h00 = 2.0 * t3 - 3.0 * t2 + 1.0
    h10 = t3 - 2.0 * t2 + t
    h01 = -2.0 * t3 + 3.0 * t2
    h11 = t3 - t2
    d00 = 6.0 * t2 - 6.0 * t
    d10 = 3.0 * t2 - 4.0 * t + 1.0
    d11 = 3.0 * t2 - 2.0 * t
    ok = keep[:, None] & feat_ok[None, :]
    at = k[:, None] * num_features + feat[None, :]
    v0 = tl.load(values_ptr + at, mask=ok, other=0.0)
    v1 = tl.load(values_ptr + at + num_features, mask=ok, other=0.0)
    m0 = tl.load(slopes_ptr + at, mask=ok, other=0.0) * spacing
    m1 = tl.load(slopes_ptr + at + num_features, mask=ok, other=0.0) * spacing
    filt = h00[:, None] * v0 + h10[:, None] * m0 + h01[:, None] * v1 + h11[:, None] * m1
    slope = (d00[:, None] * (v0 - v1) + d10[:, None] * m0 + d11[:, None] * m1) / spacing
    return filt, slope, at, h00, h10, h01, h11, spacing


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


def launch_grid(num_rows: int, block_rows: int) -> tuple[int]:
    """Programs for ``num_rows`` filter rows, ``block_rows`` each."""
    return (triton.cdiv(num_rows, block_rows),)
