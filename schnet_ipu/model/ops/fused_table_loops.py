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

Every pass computes only the outputs asked for (``need_*``: autograd's
``needs_input_grad``) and reads only the upstream gradients it is given (``has_up_*``).
Inference (forces of a model whose parameters need no gradient) thus skips the coefficient
gradient, which is four read-modify-writes of [F] per filter: the backward 1.6 -> 0.9 ms on
a 200-atom molecule (11k pairs, F = 100, float32). In force training ``U_c`` is zero (the
coefficients do not lie on the path to the positions) and is not read.

Layout: one thread, the filters in order, every inner loop over the F features of one row
with unit stride and explicit ``[row, f]`` indices, which LLVM vectorises (``fastmath``:
reassociated sums; float32 rounding stays within the tests' 1e-5). An earlier version ran
``prange`` over feature slices and sliced rows (``x[s, a:b]``) inside the loop: two threads
were 2-3x slower than one on the 2-core box (numba's OpenMP pool and torch's spin against
each other, and each row slice cost reference counting on the shared array), and one
thread 10-25% slower than these loops. Compiled on first use (a few seconds per dtype,
cached beside this file).
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the torch ops serve instead
    numba = None

AVAILABLE = numba is not None


def filter_row(coeffs, k, tp, filt):  # pragma: no cover
    """filt [F] = W of interval k at t = tp (Horner)."""
    for f in range(filt.shape[0]):
        filt[f] = ((coeffs[k, 3, f] * tp + coeffs[k, 2, f]) * tp + coeffs[k, 1, f]) * tp + coeffs[
            k, 0, f
        ]


def slope_row(coeffs, k, tp, slope):  # pragma: no cover
    """slope [F] = W' = dW/dt of interval k at t = tp."""
    for f in range(slope.shape[0]):
        slope[f] = coeffs[k, 1, f] + (2.0 * coeffs[k, 2, f] + 3.0 * coeffs[k, 3, f] * tp) * tp


def forward_loop(x, src, dst, coeffs, index, t, mask, out):  # pragma: no cover
    """out[dst[e]] += x[src[e]] * W(e) for every edge; ``index``/``t``/``mask`` [P] describe
    P filters, edge e uses filter ``e % P`` (E = P, or E = 2P for pair-symmetric storage)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    filt = np.empty(num_features, dtype=x.dtype)
    for p in range(num_filters):
        if not mask[p]:
            continue
        filter_row(coeffs, index[p], t[p], filt)
        for c in range(copies):
            s, d = src[p + c * num_filters], dst[p + c * num_filters]
            for f in range(num_features):
                out[d, f] += x[s, f] * filt[f]


def backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, need_x, need_coeffs, need_t,
    grad_x, grad_coeffs, grad_t,
):  # pragma: no cover  # fmt: skip
    """Gradients of :func:`forward_loop` with respect to x (``grad_x`` [N, F]), coeffs
    (``grad_coeffs`` [K - 1, 4, F]) and t (``grad_t`` [P]), each written only when its
    ``need_*`` is True (otherwise the array may be empty)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    filt = np.empty(num_features, dtype=x.dtype)
    slope = np.empty(num_features, dtype=x.dtype)
    both = np.empty(num_features, dtype=x.dtype)  # A = sum x[src] G[dst]
    need_both = need_coeffs or need_t
    for p in range(num_filters):
        if not mask[p]:
            continue
        k, tp = index[p], t[p]
        if need_x:
            filter_row(coeffs, k, tp, filt)
        if need_both:
            both[:] = 0.0
        for c in range(copies):
            s, d = src[p + c * num_filters], dst[p + c * num_filters]
            for f in range(num_features):  # LLVM unswitches the invariant ifs
                if need_both:
                    both[f] += x[s, f] * grad[d, f]
                if need_x:
                    grad_x[s, f] += grad[d, f] * filt[f]
        if need_coeffs:
            tp2 = tp * tp
            for f in range(num_features):
                a = both[f]
                grad_coeffs[k, 0, f] += a
                grad_coeffs[k, 1, f] += a * tp
                grad_coeffs[k, 2, f] += a * tp2
                grad_coeffs[k, 3, f] += a * tp2 * tp
        if need_t:
            slope_row(coeffs, k, tp, slope)
            slope_sum = 0.0
            for f in range(num_features):
                slope_sum += both[f] * slope[f]
            grad_t[p] = slope_sum


def double_backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, up_x, up_coeffs, up_t, has_up_coeffs,
    need_coeffs, need_t, out_grad, out_x, out_coeffs, out_t,
):  # pragma: no cover  # fmt: skip
    """Gradients of :func:`backward_loop`'s outputs contracted with ``up_x`` [N, F],
    ``up_coeffs`` [K - 1, 4, F] (read only when ``has_up_coeffs``) and ``up_t`` [P], with
    respect to grad (``out_grad``), x (``out_x``), coeffs (``out_coeffs``, written only when
    ``need_coeffs``) and t (``out_t``, only when ``need_t``); the formulas are in the module
    docstring."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    filt = np.empty(num_features, dtype=x.dtype)
    slope = np.empty(num_features, dtype=x.dtype)
    bend = np.empty(num_features, dtype=x.dtype)  # B: the filter's variation
    both = np.empty(num_features, dtype=x.dtype)  # A = sum x[src] G[dst]
    both_up = np.empty(num_features, dtype=x.dtype)  # A_u = sum U_x[src] G[dst]
    for p in range(num_filters):
        if not mask[p]:
            continue
        k, tp, ut = index[p], t[p], up_t[p]
        tp2 = tp * tp
        filter_row(coeffs, k, tp, filt)
        slope_row(coeffs, k, tp, slope)
        if has_up_coeffs:
            filter_row(up_coeffs, k, tp, bend)
        else:
            bend[:] = 0.0
        for f in range(num_features):
            bend[f] += ut * slope[f]
            both[f] = 0.0
            both_up[f] = 0.0
        for c in range(copies):
            s, d = src[p + c * num_filters], dst[p + c * num_filters]
            for f in range(num_features):
                both[f] += x[s, f] * grad[d, f]
                both_up[f] += up_x[s, f] * grad[d, f]
                out_grad[d, f] += up_x[s, f] * filt[f] + x[s, f] * bend[f]
                out_x[s, f] += grad[d, f] * bend[f]
        if need_coeffs:
            for f in range(num_features):
                a, a_up = ut * both[f], both_up[f]
                out_coeffs[k, 0, f] += a_up
                out_coeffs[k, 1, f] += a_up * tp + a
                out_coeffs[k, 2, f] += a_up * tp2 + 2.0 * a * tp
                out_coeffs[k, 3, f] += a_up * tp2 * tp + 3.0 * a * tp2
        if need_t:
            t_sum = 0.0
            for f in range(num_features):
                bent = 2.0 * coeffs[k, 2, f] + 6.0 * coeffs[k, 3, f] * tp
                t_sum += both_up[f] * slope[f] + ut * both[f] * bent
            if has_up_coeffs:
                slope_row(up_coeffs, k, tp, slope)
                for f in range(num_features):
                    t_sum += both[f] * slope[f]
            out_t[p] = t_sum


if AVAILABLE:
    _row = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True, inline="always")
    _loop = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True)
    filter_row = _row(filter_row)
    slope_row = _row(slope_row)
    forward_loop = _loop(forward_loop)
    backward_loop = _loop(backward_loop)
    double_backward_loop = _loop(double_backward_loop)
