"""The tabulated filter's convolution as torch operators over the compiled loops of
:mod:`.fused_table_loops` (numba): forward, backward and the backward's own backward, so
the op is twice differentiable (force training).

Each pass allocates its outputs; autograd's ``ctx.needs_input_grad`` decides what comes back
(None for what nobody asked for) and whether the coefficient gradient is computed at all (a
model used for forces alone, its parameters frozen, gets none). grad_x and grad_t share the
backward's one pass over the edges and are always computed.

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

from schnet_ipu.model.filter_table import grid_spacing, hermite_coefficients
from schnet_ipu.model.ops import fused_table_loops as loops
from schnet_ipu.model.ops.common import is_compiling

AVAILABLE = loops.AVAILABLE
CUSTOM_OPS = hasattr(torch.library, "custom_op")  # torch >= 2.4


def _array(tensor: Tensor) -> np.ndarray:
    """A tensor's memory as numpy (no copy when it is contiguous already)."""
    return tensor.detach().contiguous().numpy()


def _coefficient_output(coeffs: Tensor, needed: bool) -> Tensor:
    """Zeros shaped as ``coeffs`` when their gradient is needed, else [0, 0, 0] (unwritten)."""
    return torch.zeros_like(coeffs) if needed else coeffs.new_empty((0, 0, 0))


def _run_forward(
    x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, mask: Tensor
) -> Tensor:
    """out [N, F] (see :func:`fused_table_conv`)."""
    out = torch.zeros_like(x)
    src, dst = edge_index
    loops.forward_loop(
        _array(x), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), out.numpy(),
    )  # fmt: skip
    return out


def _run_backward(
    grad: Tensor, x: Tensor, edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor,
    mask: Tensor, need_coeffs: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(grad_x [N, F], grad_coeffs [K - 1, 4, F], grad_t [P]) from grad [N, F] = d loss / d out;
    grad_coeffs is [0, 0, 0] unless ``need_coeffs``."""
    grad_x, grad_t = torch.zeros_like(x), torch.zeros_like(t)
    grad_coeffs = _coefficient_output(coeffs, need_coeffs)
    src, dst = edge_index
    loops.backward_loop(
        _array(x), _array(grad), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), need_coeffs, grad_x.numpy(), grad_coeffs.numpy(), grad_t.numpy(),
    )  # fmt: skip
    return grad_x, grad_coeffs, grad_t


def _run_double_backward(
    up_x: Tensor | None, up_coeffs: Tensor | None, up_t: Tensor | None, grad: Tensor, x: Tensor,
    edge_index: Tensor, coeffs: Tensor, index: Tensor, t: Tensor, mask: Tensor,
    need_coeffs: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Gradients with respect to (grad, x, coeffs, t) of the backward's outputs contracted
    with ``up_x`` [N, F], ``up_coeffs`` [K - 1, 4, F] and ``up_t`` [P] (None: zero); the
    coefficients' is [0, 0, 0] unless ``need_coeffs``."""
    out_grad, out_x, out_t = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(t)
    out_coeffs = _coefficient_output(coeffs, need_coeffs)
    up_x = torch.zeros_like(x) if up_x is None else up_x
    up_t = torch.zeros_like(t) if up_t is None else up_t
    has_up_coeffs = up_coeffs is not None
    up_coeffs = up_coeffs if has_up_coeffs else coeffs.new_empty((0, 0, 0))
    src, dst = edge_index
    loops.double_backward_loop(
        _array(x), _array(grad), _array(src), _array(dst), _array(coeffs), _array(index),
        _array(t), _array(mask), _array(up_x), _array(up_coeffs), _array(up_t), has_up_coeffs,
        need_coeffs, out_grad.numpy(), out_x.numpy(), out_coeffs.numpy(), out_t.numpy(),
    )  # fmt: skip
    return out_grad, out_x, out_coeffs, out_t


def _or_none(tensors: tuple[Tensor, ...], needs: list[bool]) -> list[Tensor | None]:
    """The computed gradients, None for those not asked for."""
    return [tensor if need else None for tensor, need in zip(tensors, needs)]


def _engine_needs(ctx, position: int, tensor: Tensor) -> bool:
    """Whether the running backward pass uses the gradient of input ``position``, ``tensor``.

    ``ctx.needs_input_grad`` says only whether the input requires grad. The force pass of
    force training, ``autograd.grad(energy, pos, create_graph=True)``, never reaches the
    table's parameters (the table does not depend on positions), so there the coefficient
    gradient, an [K - 1, 4, F] accumulation over every edge, would be computed and thrown
    away. The engine knows which nodes the current pass will run:
    ``torch._C._will_engine_execute_node``, which torch's own
    ``torch.autograd.graph.register_multi_grad_hook`` uses for the same question (private,
    present since torch 2.0). It refuses leaves under ``autograd.grad``, so a leaf tensor's
    gradient counts as needed (in a model the coefficients are never a leaf: they are
    computed from the filter networks). Only the eager path asks: the custom operators run
    under ``torch.compile``, whose backward is traced before any engine runs it, and
    compiled steps are energy steps, which need the coefficient gradient.
    """
    if not ctx.needs_input_grad[position]:
        return False
    return tensor.grad_fn is None or torch._C._will_engine_execute_node(tensor.grad_fn)


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
        needs = [ctx.needs_input_grad[0], _engine_needs(ctx, 2, coeffs), ctx.needs_input_grad[4]]
        grads = _TableConvBackwardFunction.apply(grad, x, edge_index, coeffs, index, t, mask, needs)
        return grads[0], None, grads[1], None, grads[2], None


class _TableConvBackwardFunction(torch.autograd.Function):
    """(grad_x, grad_coeffs, grad_t) of the table convolution, None where not needed; its
    backward is the fused double backward (differentiable once more only)."""

    @staticmethod
    def forward(ctx, grad, x, edge_index, coeffs, index, t, mask, needs):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, x, edge_index, coeffs, index, t, mask)
        return tuple(
            _or_none(_run_backward(grad, x, edge_index, coeffs, index, t, mask, needs[1]), needs)
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, up_x, up_coeffs, up_t):  # type: ignore[override]
        grad, x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 3, 5)]
        out = _run_double_backward(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask, needs[2]
        )
        out = _or_none(out, needs)
        return out[0], out[1], None, out[2], None, out[3], None, None


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
        schema=f"(Tensor grad, {_INPUTS}, bool need_coeffs) -> (Tensor, Tensor, Tensor)",
    )  # fmt: skip
    def _table_conv_backward_op(grad, x, edge_index, coeffs, index, t, mask, need_coeffs):
        return _run_backward(grad, x, edge_index, coeffs, index, t, mask, need_coeffs)

    @torch.library.custom_op(
        "schnet_ipu::table_conv_double_backward", mutates_args=(), device_types="cpu",
        schema="(Tensor? up_x, Tensor? up_coeffs, Tensor? up_t, Tensor grad, "
        f"{_INPUTS}, bool need_coeffs) -> (Tensor, Tensor, Tensor, Tensor)",
    )  # fmt: skip
    def _table_conv_double_backward_op(
        up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask, need_coeffs
    ):
        return _run_double_backward(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask, need_coeffs
        )

    def _fake_coefficients(coeffs: Tensor, needed: bool) -> Tensor:
        return torch.empty_like(coeffs) if needed else coeffs.new_empty((0, 0, 0))

    @_table_conv_op.register_fake
    def _(x, edge_index, coeffs, index, t, mask):
        return torch.empty_like(x)

    @_table_conv_backward_op.register_fake
    def _(grad, x, edge_index, coeffs, index, t, mask, need_coeffs):
        return torch.empty_like(x), _fake_coefficients(coeffs, need_coeffs), torch.empty_like(t)

    @_table_conv_double_backward_op.register_fake
    def _(up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask, need_coeffs):
        coefficients = _fake_coefficients(coeffs, need_coeffs)
        return torch.empty_like(x), torch.empty_like(x), coefficients, torch.empty_like(t)

    def _save_inputs(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    def _table_conv_grads(ctx, grad):
        x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 2, 4)]
        grads = _or_none(
            _table_conv_backward_op(grad, x, edge_index, coeffs, index, t, mask, needs[1]), needs
        )
        return grads[0], None, grads[1], None, grads[2], None

    def _save_backward_inputs(ctx, inputs, output) -> None:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[:-1])

    def _table_conv_backward_grads(ctx, up_x, up_coeffs, up_t):
        grad, x, edge_index, coeffs, index, t, mask = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 3, 5)]
        out = _table_conv_double_backward_op(
            up_x, up_coeffs, up_t, grad, x, edge_index, coeffs, index, t, mask, needs[2]
        )
        out = _or_none(out, needs)
        return out[0], out[1], None, out[2], None, out[3], None, None

    _table_conv_op.register_autograd(_table_conv_grads, setup_context=_save_inputs)
    _table_conv_backward_op.register_autograd(
        _table_conv_backward_grads, setup_context=_save_backward_inputs
    )


class _HermiteCoefficients(torch.autograd.Function):
    """:func:`~schnet_ipu.model.filter_table.hermite_coefficients` with its backward written
    out. Autograd's own backward of the plain version goes through four row slices of the
    table (``values[:-1]``, ``values[1:]``, ...), each of which builds a zero [K, F] tensor
    to place its gradient in; here the gradient is two shifted sums of [K - 1, F] rows
    (table build and Hermite stage of three blocks, forward and backward, EMT model, K =
    256, thread CPU time: 3.45 against 3.83 ms). The backward is made of torch ops, so the
    coefficients stay differentiable twice."""

    @staticmethod
    def forward(ctx, values: Tensor, slopes: Tensor, cutoff: float) -> Tensor:  # type: ignore[override]
        ctx.step = grid_spacing(cutoff, values.shape[0])
        return hermite_coefficients(values, slopes, cutoff)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        # c0 = v0, c1 = m0, c2 = 3 (v1 - v0) - 2 m0 - m1, c3 = 2 (v0 - v1) + m0 + m1, m = h s
        g0, g1, g2, g3 = grad.unbind(1)  # [K - 1, F] each
        to_next = 3.0 * g2 - 2.0 * g3  # d/dv1, and minus the v0 part of d/dv0 beyond g0
        next_slope = g3 - g2  # d/dm1
        edge = grad.new_zeros(1, grad.shape[2])
        d_values = torch.cat([g0 - to_next, edge]) + torch.cat([edge, to_next])
        d_slopes = torch.cat([g1 - g2 + next_slope, edge]) + torch.cat([edge, next_slope])
        return d_values, d_slopes * ctx.step, None


def table_coefficients(values: Tensor, slopes: Tensor, cutoff: float) -> Tensor:
    """The cubic coefficients [K - 1, 4, F] of a table (values, slopes [K, F]) that
    :func:`fused_table_conv` reads, differentiable twice."""
    return _HermiteCoefficients.apply(values, slopes, cutoff)


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
