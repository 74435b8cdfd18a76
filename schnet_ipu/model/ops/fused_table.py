"""The tabulated filter's convolution as compiled CPU loops (numba): forward, backward and
the backward's own backward (force training).

``table_conv`` written in torch ops (:func:`schnet_ipu.model.filter_table.hermite_filter`
followed by gather, multiply and scatter) passes over [E, F] tensors about ten times forward
and twenty times backward. Here one loop per pass walks the edges once: it evaluates each
edge's filter from the cubic coefficients of its grid interval in registers, multiplies the
source row of ``x`` and adds into the receiver row. No [E, F] tensor is ever allocated.

With ``W(p, f) = c0 + c1 t + c2 t^2 + c3 t^3`` (the coefficients of filter p's interval k_p,
at its position t_p) and ``G = d loss / d out``, the three passes are

* forward: ``out[dst e] += x[src e] W(p)`` over the edges e of each filter p;
* backward (:func:`_backward_loop`): ``grad_x[src e] += G[dst e] W(p)``; with
  ``A(p) = sum_e x[src e] G[dst e]`` (d loss / d W), ``grad_coeffs[k_p, j] += A t^j`` and
  ``grad_t[p] = sum_f A W'``, ``W' = c1 + 2 c2 t + 3 c3 t^2``;
* double backward (:func:`_double_backward_loop`): given the gradients ``U_x``, ``U_c``,
  ``u_t`` of a loss on the backward's three outputs, differentiate
  ``L = <U_x, grad_x> + <U_c, grad_coeffs> + <u_t, grad_t>
  = sum_e sum_f G[dst e] (U_x[src e] W(p) + x[src e] B(p))`` with the filter's variation
  ``B(p) = sum_j U_c[k_p, j] t^j + u_t[p] W'(p)``: d L / d G[dst e] += U_x[src e] W + x[src e] B,
  d L / d x[src e] += G[dst e] B, and with ``A_u(p) = sum_e U_x[src e] G[dst e]``
  d L / d c_j += A_u t^j + u_t A j t^(j-1), d L / d t = sum_f A_u W' + A (u_t W'' +
  sum_j j U_c[k_p, j] t^(j-1)), ``W'' = 2 c2 + 6 c3 t``. The cubic's own derivatives, so
  the result is exact for the interpolant.

In force training the loss on the forces reaches the backward through ``grad_x`` (earlier
blocks) and ``grad_t`` (the positions); ``U_c`` is then zero (the coefficients do not lie on
the path to the positions) and its reads are skipped. The double backward's outputs are what
the parameter gradient needs: d L / d G and d L / d x flow on to the layers, d L / d c to the
filter network through the table, d L / d t to the positions (Hessian products).

The loops run in parallel over slices of the F features (each thread owns its columns of
every output, so scatters need no atomics), one slice per torch thread, and are written over
row slices with unit-stride inner loops, which numba vectorises (``fastmath``: 3x faster than
indexing [row, f] in the inner loop on the 2-core box). Compiled on first use (~5 s per dtype,
cached beside this file).

Autograd: on torch >= 2.4 the three passes are custom operators (``torch.library.custom_op``
with ``register_fake`` and ``register_autograd``, following the torch.library documentation,
https://docs.pytorch.org/docs/2.4/library.html, and the tutorial "Adding training and other
registrations to Python custom operators", docs.pytorch.org/tutorials/advanced/
python_custom_ops_registrations.html: "if you need a non-traceable backward, make it a separate
custom_op that you call inside backward_fn"), so ``torch.compile`` keeps them as opaque calls;
on older torch (the IPU SDK's 2.0.1) the same passes are ``torch.autograd.Function`` s. Either
way the op is twice differentiable; the double backward itself is not differentiated again.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.model.ops.common import is_compiling

try:
    import numba
except ImportError:  # the torch ops serve instead
    numba = None

AVAILABLE = numba is not None
CUSTOM_OPS = hasattr(torch.library, "custom_op")  # torch >= 2.4


def _filter_values(coeffs, k, tp, start, stop, filt):  # pragma: no cover
    """filt[f] = W of interval k at t = tp for the features start..stop (Horner)."""
    c0, c1 = coeffs[k, 0, start:stop], coeffs[k, 1, start:stop]
    c2, c3 = coeffs[k, 2, start:stop], coeffs[k, 3, start:stop]
    for f in range(stop - start):
        filt[f] = ((c3[f] * tp + c2[f]) * tp + c1[f]) * tp + c0[f]


def _forward_loop(x, src, dst, coeffs, index, t, mask, num_slices, out):  # pragma: no cover
    """out[dst[e]] += x[src[e]] * W(e) for every edge; ``index``/``t``/``mask`` [P] describe
    P filters, edge e uses filter ``e % P`` (E = P, or E = 2P for pair-symmetric storage)."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    width = (num_features + num_slices - 1) // num_slices
    for slice_ in numba.prange(num_slices):
        start, stop = slice_ * width, min(num_features, slice_ * width + width)
        filt = np.empty(stop - start, dtype=x.dtype)
        for p in range(num_filters):
            if not mask[p]:
                continue
            _filter_values(coeffs, index[p], t[p], start, stop, filt)
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
            _filter_values(coeffs, k, tp, start, stop, filt)
            grad_filt[:] = 0.0
            for c in range(copies):
                e = p + c * num_filters
                source, incoming = x[src[e], start:stop], grad[dst[e], start:stop]
                row = grad_x[src[e], start:stop]
                for f in range(stop - start):
                    grad_filt[f] += source[f] * incoming[f]
                    row[f] += incoming[f] * filt[f]
            c1, c2, c3 = (
                coeffs[k, 1, start:stop],
                coeffs[k, 2, start:stop],
                coeffs[k, 3, start:stop],
            )
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


def _double_backward_loop(
    x, grad, src, dst, coeffs, index, t, mask, up_x, up_coeffs, up_t, has_up_coeffs,
    num_slices, out_x, out_grad, out_coeffs, out_t_parts,
):  # pragma: no cover  # fmt: skip
    """Gradients of :func:`_backward_loop`'s outputs contracted with ``up_x`` [N, F],
    ``up_coeffs`` [K - 1, 4, F] (read only when ``has_up_coeffs``) and ``up_t`` [P], with
    respect to x (``out_x``), grad (``out_grad``), coeffs (``out_coeffs``) and t
    (``out_t_parts`` [num_slices, P], partial sums); the formulas are in the module
    docstring."""
    num_filters, num_features = index.shape[0], x.shape[1]
    copies = src.shape[0] // num_filters
    width = (num_features + num_slices - 1) // num_slices
    for slice_ in numba.prange(num_slices):
        start, stop = slice_ * width, min(num_features, slice_ * width + width)
        size = stop - start
        filt = np.empty(size, dtype=x.dtype)
        slope = np.empty(size, dtype=x.dtype)
        bend = np.empty(size, dtype=x.dtype)  # B: the filter's variation
        both = np.empty(size, dtype=x.dtype)  # A = sum x[src] G[dst]
        both_up = np.empty(size, dtype=x.dtype)  # A_u = sum U_x[src] G[dst]
        for p in range(num_filters):
            if not mask[p]:
                continue
            k, tp, ut = index[p], t[p], up_t[p]
            tp2 = tp * tp
            _filter_values(coeffs, k, tp, start, stop, filt)
            c1, c2, c3 = (
                coeffs[k, 1, start:stop],
                coeffs[k, 2, start:stop],
                coeffs[k, 3, start:stop],
            )
            for f in range(size):
                slope[f] = c1[f] + 2.0 * c2[f] * tp + 3.0 * c3[f] * tp2
                bend[f] = ut * slope[f]
                both[f] = 0.0
                both_up[f] = 0.0
            if has_up_coeffs:
                _filter_values(up_coeffs, k, tp, start, stop, both)  # scratch: U_c's cubic
                for f in range(size):
                    bend[f] += both[f]
                    both[f] = 0.0
            for c in range(copies):
                e = p + c * num_filters
                s, d = src[e], dst[e]
                source, incoming, upstream = (
                    x[s, start:stop],
                    grad[d, start:stop],
                    up_x[s, start:stop],
                )
                row_x, row_grad = out_x[s, start:stop], out_grad[d, start:stop]
                for f in range(size):
                    both[f] += source[f] * incoming[f]
                    both_up[f] += upstream[f] * incoming[f]
                    row_grad[f] += upstream[f] * filt[f] + source[f] * bend[f]
                    row_x[f] += incoming[f] * bend[f]
            g0, g1 = out_coeffs[k, 0, start:stop], out_coeffs[k, 1, start:stop]
            g2, g3 = out_coeffs[k, 2, start:stop], out_coeffs[k, 3, start:stop]
            t_sum = 0.0
            for f in range(size):
                a, a_up = both[f], both_up[f]
                g0[f] += a_up
                g1[f] += a_up * tp + ut * a
                g2[f] += a_up * tp2 + 2.0 * ut * a * tp
                g3[f] += a_up * tp2 * tp + 3.0 * ut * a * tp2
                t_sum += a_up * slope[f] + ut * a * (2.0 * c2[f] + 6.0 * c3[f] * tp)
            if has_up_coeffs:
                u1, u2 = up_coeffs[k, 1, start:stop], up_coeffs[k, 2, start:stop]
                u3 = up_coeffs[k, 3, start:stop]
                for f in range(size):
                    t_sum += both[f] * (u1[f] + 2.0 * u2[f] * tp + 3.0 * u3[f] * tp2)
            out_t_parts[slice_, p] = t_sum


if AVAILABLE:
    _compile = numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False, fastmath=True)
    _filter_values = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True)(
        _filter_values
    )
    _forward_loop = _compile(_forward_loop)
    _backward_loop = _compile(_backward_loop)
    _double_backward_loop = _compile(_double_backward_loop)


def _array(tensor: Tensor) -> np.ndarray:
    """A contiguous tensor's memory as numpy (no copy when it is contiguous already)."""
    return tensor.detach().contiguous().numpy()


def _slices(x: Tensor) -> int:
    """Feature slices for the loops: one per torch thread (at most F).

    numba's OpenMP threading layer shares torch's OpenMP runtime, and starting its thread
    pool sets the runtime's thread count to numba's (all cores): torch then ran on all cores
    whatever ``backend.threads`` said (a 200 x 200 matmul 10x slower on the loaded 2-core
    box). So numba is given torch's count and torch's is set back after the pool starts."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(threads)
    torch.set_num_threads(threads)
    return min(threads, x.shape[1])


def _run_forward(
    x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, mask: Tensor
) -> Tensor:
    """out [N, F] (see :func:`fused_table_conv`)."""
    out = torch.zeros_like(x)
    src, dst = edge_index
    _forward_loop(
        _array(x), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), _slices(x), out.numpy(),
    )  # fmt: skip
    return out


def _run_backward(
    grad: Tensor, x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor,
    mask: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(grad_x [N, F], grad_coeffs [K - 1, 4, F], grad_t [P]) from grad [N, F] = d loss / d out."""
    slices = _slices(x)
    grad_x, grad_coeffs = torch.zeros_like(x), torch.zeros_like(coeffs)
    grad_t_parts = t.new_zeros((slices, index.shape[0]))
    src, dst = edge_index
    _backward_loop(
        _array(x), _array(grad), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), slices, grad_x.numpy(), grad_coeffs.numpy(), grad_t_parts.numpy(),
    )  # fmt: skip
    return grad_x, grad_coeffs, grad_t_parts.sum(0)


def _run_double_backward(
    up_x: Tensor | None, up_coeffs: Tensor | None, up_t: Tensor | None, grad: Tensor, x: Tensor,
    edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, mask: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients with respect to (grad, x, coeffs, t) of the backward's outputs contracted
    with ``up_x`` [N, F], ``up_coeffs`` [K - 1, 4, F] and ``up_t`` [P] (None: zero)."""
    slices = _slices(x)
    out_grad, out_x, out_coeffs = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(coeffs)
    out_t_parts = t.new_zeros((slices, index.shape[0]))
    up_x = torch.zeros_like(x) if up_x is None else up_x
    up_t = torch.zeros_like(t) if up_t is None else up_t
    has_up_coeffs = up_coeffs is not None
    up_coeffs = coeffs.new_zeros((1, 4, 1)) if up_coeffs is None else up_coeffs
    src, dst = edge_index
    _double_backward_loop(
        _array(x), _array(grad), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), _array(up_x), _array(up_coeffs), _array(up_t), has_up_coeffs,
        slices, out_x.numpy(), out_grad.numpy(), out_coeffs.numpy(), out_t_parts.numpy(),
    )  # fmt: skip
    return out_grad, out_x, out_coeffs, out_t_parts.sum(0)


# --- autograd on torch < 2.4: autograd.Function ------------------------------------------


class _TableConvFunction(torch.autograd.Function):
    """See :func:`fused_table_conv`; the backward is :class:`_TableConvBackwardFunction`, so
    under ``create_graph`` it is differentiable again."""

    @staticmethod
    def forward(ctx, x, edge_index, coeffs, index, t, mask):  # type: ignore[override]
        ctx.save_for_backward(x, edge_index, coeffs, index, t, mask)
        return _run_forward(x, edge_index, coeffs, index, t, mask)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        grads = _TableConvBackwardFunction.apply(grad, x, edge_index, coeffs, index, t, mask)
        return grads[0], None, grads[1], None, grads[2], None


class _TableConvBackwardFunction(torch.autograd.Function):
    """(grad_x, grad_coeffs, grad_t) of the table convolution; its backward is the fused
    double backward (differentiable once more only)."""

    @staticmethod
    def forward(ctx, grad, x, edge_index, coeffs, index, t, mask):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, x, edge_index, coeffs, index, t, mask)
        return _run_backward(grad, x, edge_index, coeffs, index, t, mask)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, up_x, up_coeffs, up_t):  # type: ignore[override]
        grad, x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        out = _run_double_backward(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask
        )
        return out[0], out[1], None, out[2], None, out[3], None


# --- autograd on torch >= 2.4: custom operators (torch.compile keeps them) ----------------

_INPUTS = "Tensor x, Tensor edge_index, Tensor coeffs, Tensor index, Tensor t, Tensor mask"

if CUSTOM_OPS:

    @torch.library.custom_op(
        "schnet_ipu::table_conv", mutates_args=(), device_types="cpu",
        schema=f"({_INPUTS}) -> Tensor",
    )  # fmt: skip
    def _table_conv_op(x, edge_index, coeffs, index, t, mask):
        return _run_forward(x, edge_index, coeffs, index, t, mask)

    @torch.library.custom_op(
        "schnet_ipu::table_conv_backward", mutates_args=(), device_types="cpu",
        schema=f"(Tensor grad, {_INPUTS}) -> (Tensor, Tensor, Tensor)",
    )  # fmt: skip
    def _table_conv_backward_op(grad, x, edge_index, coeffs, index, t, mask):
        return _run_backward(grad, x, edge_index, coeffs, index, t, mask)

    @torch.library.custom_op(
        "schnet_ipu::table_conv_double_backward", mutates_args=(), device_types="cpu",
        schema="(Tensor? up_x, Tensor? up_coeffs, Tensor? up_t, Tensor grad, "
        f"{_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor)",
    )  # fmt: skip
    def _table_conv_double_backward_op(
        up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask
    ):
        return _run_double_backward(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask
        )

    @_table_conv_op.register_fake
    def _(x, edge_index, coeffs, index, t, mask):
        return torch.empty_like(x)

    @_table_conv_backward_op.register_fake
    def _(grad, x, edge_index, coeffs, index, t, mask):
        return torch.empty_like(x), torch.empty_like(coeffs), torch.empty_like(t)

    @_table_conv_double_backward_op.register_fake
    def _(up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask):
        return (torch.empty_like(x), torch.empty_like(x), torch.empty_like(coeffs),
                torch.empty_like(t))  # fmt: skip

    def _save_inputs(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def _table_conv_grads(ctx, grad):
        x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        grads = _table_conv_backward_op(grad, x, edge_index, coeffs, index, t, mask)
        return grads[0], None, grads[1], None, grads[2], None

    def _save_backward_inputs(ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)

    def _table_conv_backward_grads(ctx, up_x, up_coeffs, up_t):
        grad, x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        out = _table_conv_double_backward_op(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask
        )
        return out[0], out[1], None, out[2], None, out[3], None

    _table_conv_op.register_autograd(_table_conv_grads, setup_context=_save_inputs)
    _table_conv_backward_op.register_autograd(
        _table_conv_backward_grads, setup_context=_save_backward_inputs
    )


def fused_table_conv(
    x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, edge_mask: Tensor,
    custom_op: bool | None = None,
) -> Tensor:  # fmt: skip
    """``out[i] = sum over edges j -> i of x[j] * W(e)``, W from the cubic ``coeffs``
    [K - 1, 4, F] of interval ``index`` [P] at position ``t`` [P] (see
    :func:`schnet_ipu.model.filter_table.grid_position`); ``edge_mask`` [P] False: no
    message. x [N, F] on the CPU, edge_index [2, E] with E = P or 2P (pair-symmetric: edge
    ``p + P`` is edge p reversed). Returns [N, F] with x's dtype (float32 or float64).
    Twice differentiable in x, coeffs and t.

    ``custom_op``: run as the custom operator (True; torch >= 2.4) or the autograd.Function
    (False); None: the custom operator under ``torch.compile`` only, since in eager mode its
    dispatch costs more (force step on the EMT config: 27.5 against 25.7 ms, energy step 20.2
    against 18.0, interleaved, load average 7.9 on the 2-core box)."""
    inputs = (x, edge_index, coeffs.to(x.dtype), index, t.to(x.dtype), edge_mask)
    if custom_op is None:
        custom_op = CUSTOM_OPS and is_compiling()
    if custom_op:
        return _table_conv_op(*inputs)
    return _TableConvFunction.apply(*inputs)
