"""The tabulated filter's convolution as compiled CPU loops (numba): forward, backward and
the backward's own backward (force training). :mod:`.fused_table` runs them as torch ops.

``table_conv`` written in torch ops (:func:`schnet_ipu.model.filter_table.hermite_filter`
followed by gather, multiply and scatter) passes over [E, F] tensors about ten times forward
and twenty times backward. Here one loop per pass walks the edges once: it evaluates each
edge's filter from the cubic coefficients of its grid interval, multiplies the source row of
``x`` and adds into the receiver row. No [E, F] tensor is ever allocated.

With ``W(p, f) = c0 + c1 t + c2 t^2 + c3 t^3`` (the coefficients of filter p's interval k_p,
at its position t_p) and ``G = d loss / d out``, the three passes are

* forward: ``out[dst e] += x[src e] W(p)`` over the edges e of each filter p;
* backward (:func:`backward_loop`): ``grad_x[src e] += G[dst e] W(p)``; with
  ``A(p) = sum_e x[src e] G[dst e]`` (d loss / d W), ``grad_coeffs[k_p, j] += A t^j`` and
  ``grad_t[p] = sum_f A W'``, ``W' = c1 + 2 c2 t + 3 c3 t^2``;
* double backward (:func:`double_backward_loop`): given the gradients ``U_x``, ``U_c``,
  ``u_t`` of a loss on the backward's three outputs, differentiate
  ``L = <U_x, grad_x> + <U_c, grad_coeffs> + <u_t, grad_t>
  = sum_e sum_f G[dst e] (U_x[src e] W(p) + x[src e] B(p))`` with the filter's variation
  ``B(p) = sum_j U_c[k_p, j] t^j + u_t[p] W'(p)``: d L / d G[dst e] += U_x[src e] W + x[src e] B,
  d L / d x[src e] += G[dst e] B, and with ``A_u(p) = sum_e U_x[src e] G[dst e]``
  d L / d c_j += A_u t^j + u_t A j t^(j-1), d L / d t = sum_f A_u W' + A (u_t W'' +
  sum_j j U_c[k_p, j] t^(j-1)), ``W'' = 2 c2 + 6 c3 t``. The cubic's own derivatives, so
  the result is exact for the interpolant.

The coefficient gradient is computed only when asked for (``need_coeffs``: autograd's
``needs_input_grad``): inference (forces of a frozen model) skips its four read-modify-writes
of [F] per filter. In force training ``U_c`` is zero (the coefficients do not lie on the path
to the positions) and is not read.

Layout: one thread; per filter, one loop over the F features of its one or two edges (the
pair-symmetric layout's two directions share the filter and its coefficient reads) with
explicit ``[row, f]`` indices, the filter, its slope and every per-filter sum in registers.
What the measurements (thread CPU time, 200-atom molecule, 11k pairs, F = 100, float32)
taught: LLVM vectorises these loops (``fastmath``: reassociated sums) only when they carry at
most one loop-invariant branch (``two``), so optional work goes in a loop of its own
(:func:`coefficient_gradient`, which re-reads the rows while they are in L1); float64
literals or accumulators in a float32 kernel halve the vector width (``c + c``, not
``2.0 * c``; sums start from a zero of x's dtype: inference backward 1.00 -> 0.67 ms);
scratch rows between loops cost more than they save. The earlier loops (``prange`` over
feature slices, row slices ``x[s, a:b]``, a scratch row per quantity) took 0.69 / 1.64 /
2.93 ms for forward / backward / double backward against 0.50 / 1.21 / 2.09 here (same
run, load 9.5), and with two threads 2-3x longer than with one on the 2-core box (numba's
OpenMP pool and torch's spin against each other); splitting the filters over two Python
threads lost too (0.53 against 0.48 ms forward at best, load 12). Compiled on first use (a
few seconds per dtype, cached beside this file).
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the torch ops serve instead
    numba = None

AVAILABLE = numba is not None


def cubic(coeffs, k, f, tp):  # pragma: no cover
    """(W, W' = dW/dt) of feature f in interval k at t = tp."""
    c0, c1, c2, c3 = coeffs[k, 0, f], coeffs[k, 1, f], coeffs[k, 2, f], coeffs[k, 3, f]
    return ((c3 * tp + c2) * tp + c1) * tp + c0, c1 + (c2 + c2 + (c3 + c3 + c3) * tp) * tp


def filter_edges(src, dst, p, num_filters, two):  # pragma: no cover
    """(source, receiver) of filter p's edge and of its second edge p + P (the first again
    when there is none)."""
    if two:
        return src[p], dst[p], src[p + num_filters], dst[p + num_filters]
    return src[p], dst[p], src[p], dst[p]


def forward_loop(x, src, dst, coeffs, index, t, mask, out):  # pragma: no cover
    """out[dst[e]] += x[src[e]] * W(e) for every edge; ``index``/``t``/``mask`` [P] describe
    P filters, edge e uses filter ``e % P`` (E = P, or E = 2P for pair-symmetric storage)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    two = src.shape[0] > num_filters  # edge p + P: the second edge of filter p
    for p in range(num_filters):
        if not mask[p]:
            continue
        k, tp = index[p], t[p]
        s1, d1, s2, d2 = filter_edges(src, dst, p, num_filters, two)
        for f in range(num_features):
            w = cubic(coeffs, k, f, tp)[0]
            out[d1, f] += x[s1, f] * w
            if two:
                out[d2, f] += x[s2, f] * w


def coefficient_gradient(
    x, grad, up, s1, d1, s2, d2, two, k, tp, ut, out_coeffs
):  # pragma: no cover  # fmt: skip
    """out_coeffs[k, j] += A_u t^j + u_t A j t^(j-1) with A = sum x[src] G[dst] and A_u =
    sum up[src] G[dst] over the filter's edges (the backward: up = x, u_t = 0)."""
    tp2 = tp * tp
    for f in range(x.shape[1]):
        g1 = grad[d1, f]
        a, a_up = x[s1, f] * g1, up[s1, f] * g1
        if two:
            g2 = grad[d2, f]
            a += x[s2, f] * g2
            a_up += up[s2, f] * g2
        a *= ut
        out_coeffs[k, 0, f] += a_up
        out_coeffs[k, 1, f] += a_up * tp + a
        out_coeffs[k, 2, f] += a_up * tp2 + (a + a) * tp
        out_coeffs[k, 3, f] += a_up * tp2 * tp + (a + a + a) * tp2


def backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, need_coeffs, grad_x, grad_coeffs, grad_t
):  # pragma: no cover  # fmt: skip
    """Gradients of :func:`forward_loop` with respect to x (``grad_x`` [N, F]), t
    (``grad_t`` [P]) and, when ``need_coeffs``, coeffs (``grad_coeffs`` [K - 1, 4, F],
    otherwise unwritten)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    two = src.shape[0] > num_filters
    zero = np.zeros(1, dtype=x.dtype)[0]
    for p in range(num_filters):
        if not mask[p]:
            continue
        k, tp = index[p], t[p]
        s1, d1, s2, d2 = filter_edges(src, dst, p, num_filters, two)
        slope_sum = zero
        for f in range(num_features):
            w, slope = cubic(coeffs, k, f, tp)
            g1 = grad[d1, f]
            a = x[s1, f] * g1
            grad_x[s1, f] += g1 * w
            if two:
                g2 = grad[d2, f]
                a += x[s2, f] * g2
                grad_x[s2, f] += g2 * w
            slope_sum += a * slope
        grad_t[p] = slope_sum
        if need_coeffs:
            coefficient_gradient(x, grad, x, s1, d1, s2, d2, two, k, tp, zero, grad_coeffs)


def double_backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, up_x, up_coeffs, up_t, has_up_coeffs,
    need_coeffs, out_grad, out_x, out_coeffs, out_t,
):  # pragma: no cover  # fmt: skip
    """Gradients of :func:`backward_loop`'s outputs contracted with ``up_x`` [N, F],
    ``up_coeffs`` [K - 1, 4, F] (read only when ``has_up_coeffs``) and ``up_t`` [P], with
    respect to grad (``out_grad``), x (``out_x``), t (``out_t``) and, when ``need_coeffs``,
    coeffs (``out_coeffs``); the formulas are in the module docstring."""
    num_filters, num_features = index.shape[0], x.shape[1]
    two = src.shape[0] > num_filters
    up_filt = np.zeros(num_features, dtype=x.dtype)  # U_c's cubic and slope (0 without)
    up_slope = np.zeros(num_features, dtype=x.dtype)
    zero = up_slope[0]
    for p in range(num_filters):
        if not mask[p]:
            continue
        k, tp, ut = index[p], t[p], up_t[p]
        s1, d1, s2, d2 = filter_edges(src, dst, p, num_filters, two)
        if has_up_coeffs:
            for f in range(num_features):
                up_filt[f], up_slope[f] = cubic(up_coeffs, k, f, tp)
        t_sum = zero
        for f in range(num_features):
            w, slope = cubic(coeffs, k, f, tp)
            bend = ut * slope + up_filt[f]  # B: the filter's variation
            g1, x1, u1 = grad[d1, f], x[s1, f], up_x[s1, f]
            a, a_up = x1 * g1, u1 * g1
            out_grad[d1, f] += u1 * w + x1 * bend
            out_x[s1, f] += g1 * bend
            if two:
                g2, x2, u2 = grad[d2, f], x[s2, f], up_x[s2, f]
                a += x2 * g2
                a_up += u2 * g2
                out_grad[d2, f] += u2 * w + x2 * bend
                out_x[s2, f] += g2 * bend
            c2, c3 = coeffs[k, 2, f], coeffs[k, 3, f]
            bent = c2 + c2 + (c3 + c3 + c3) * (tp + tp)  # W''
            t_sum += a_up * slope + a * (ut * bent + up_slope[f])
        out_t[p] = t_sum
        if need_coeffs:
            coefficient_gradient(x, grad, up_x, s1, d1, s2, d2, two, k, tp, ut, out_coeffs)


if AVAILABLE:
    _row = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True, inline="always")
    _loop = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True)
    cubic = _row(cubic)
    filter_edges = _row(filter_edges)
    coefficient_gradient = _row(coefficient_gradient)
    forward_loop = _loop(forward_loop)
    backward_loop = _loop(backward_loop)
    double_backward_loop = _loop(double_backward_loop)
