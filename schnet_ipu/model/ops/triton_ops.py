"""The ``triton`` op flavour (CUDA): the torch flavour with fused message-passing kernels.

``model.ops=triton`` swaps two primitives of :class:`~.torch_ops.TorchOps` for Triton
kernels (:mod:`.triton_kernels`) that gather the senders' rows, multiply by the filter and
add into the receivers in one pass, forward and backward, never writing the [E, F] messages
(and, for the table, the backward's own backward under ``create_graph`` too:
:mod:`.triton_table_kernels`):

* ``pair_symmetric_conv(x, edge_index, filt)``: the exact per-pair filter [P, F];
* ``table_conv(x, edge_index, dist, edge_mask, values, slopes, cutoff)``: the filter
  interpolated from a table of one interaction block (cubic Hermite; the contract is in
  :func:`table_conv`).

Everything else is the torch flavour's. The kernels run on CUDA tensors, or on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported:
the opt-in tests, marker ``triton``). Triton is optional: without it, choosing the flavour is a
one-line :class:`~schnet_ipu.config.ConfigError`.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch
from torch import Tensor

from schnet_ipu.config import ConfigError
from schnet_ipu.model.ops.torch_ops import TorchOps

AVAILABLE = importlib.util.find_spec("triton") is not None


def _kernels(x: Tensor) -> ModuleType:
    """The kernel module (its custom ops launch the kernels); refuses tensors they cannot
    run on."""
    if not x.is_cuda and not interpreted():
        raise ConfigError(
            f"model.ops=triton runs its kernels on CUDA tensors, not {x.device} (CPU tensors "
            "only under TRITON_INTERPRET=1, for tests); use model.ops=torch here"
        )
    from schnet_ipu.model.ops import triton_kernels

    return triton_kernels


def interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, read by ``triton.jit`` and
    by triton's own library when they are first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _FilterSource:
    """Where a kernel reads the filter: the per-row filter [R, F], or the table (values and
    slopes [K, F] at knot spacing h, with dist and edge_mask [R]). Unused pointers are
    given ``x``; the kernels never read them (``TABLE`` is a compile-time switch)."""

    def __init__(self, x: Tensor, filt: Tensor | None = None, table: tuple | None = None):
        self.table = table is not None
        self.filt = x if filt is None else filt
        if table is None:
            self.values = self.slopes = self.dist = self.mask = self.spacing = x
            return
        self.dist, self.mask, self.values, self.slopes, cutoff = table
        spacing = cutoff / (self.values.shape[0] - 1)  # torch.full: no host copy (capture)
        self.spacing = torch.full((1,), spacing, dtype=x.dtype, device=x.device)

    def tensors(self) -> tuple[Tensor, ...]:
        """filt, values, slopes, dist, mask, spacing: the custom ops' filter arguments."""
        return self.filt, self.values, self.slopes, self.dist, self.mask, self.spacing


def _conv_forward(x: Tensor, edge_index: Tensor, rows: int, source: _FilterSource) -> Tensor:
    """out [N, F] = sum over edges of x[src] * filter; ``rows`` filter rows, E = rows or
    2 rows (pair-symmetric)."""
    kernels = _kernels(x)
    return kernels.fused_conv(x, edge_index, *source.tensors(), rows, source.table)


def _conv_backward(
    grad: Tensor, x: Tensor, edge_index: Tensor, rows: int, source: _FilterSource,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """Gradients (x, filt, values, slopes, dist) of :func:`_conv_forward`, None where
    ``needs`` = (x, filter or table, dist) says so."""
    kernels = _kernels(x)
    grads = kernels.fused_conv_backward(
        grad, x, edge_index, *source.tensors(), rows, source.table, *needs
    )
    need_x, need_filt, need_dist = needs
    return _or_none(grads, (need_x, need_filt, need_filt, need_filt, need_dist))


def _or_none(tensors, wanted) -> tuple[Tensor | None, ...]:
    """The tensors, None where ``wanted`` is False."""
    return tuple(t if want else None for t, want in zip(tensors, wanted))


def _or_zeros(tensor: Tensor | None, like: Tensor) -> Tensor:
    """``tensor``, or zeros shaped as ``like`` for an absent (None) upstream gradient."""
    return torch.zeros_like(like) if tensor is None else tensor


class _PairSymmetricConv(torch.autograd.Function):
    """:func:`pair_symmetric_conv` by the fused kernels. Without ``create_graph`` the
    backward is one kernel launch; under it (force training) two differentiable fused ops:
    grad_x is this convolution of the incoming gradient (each pair's edges run both ways, so
    sending G back along the edges is convolving G), grad_filt :class:`_PairProducts`."""

    @staticmethod
    def forward(ctx, x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
        ctx.save_for_backward(x, edge_index, filt)
        return _conv_forward(x, edge_index, filt.shape[0], _FilterSource(x, filt=filt))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, edge_index, filt = ctx.saved_tensors
        need_x, _, need_filt = ctx.needs_input_grad
        if torch.is_grad_enabled():
            grad = grad.contiguous()
            grad_x = _PairSymmetricConv.apply(grad, edge_index, filt) if need_x else None
            grad_filt = _PairProducts.apply(x, grad, edge_index) if need_filt else None
            return grad_x, None, grad_filt
        needs = (need_x, need_filt, False)
        grads = _conv_backward(grad, x, edge_index, filt.shape[0], _FilterSource(x, filt), needs)
        return grads[0], None, grads[1]


class _PairProducts(torch.autograd.Function):
    """products [P, F] = sum over pair p's two edges of x[src] * grad[dst] (the gradient of
    :func:`pair_symmetric_conv` in its filter) by the fused backward kernel. Its gradient in
    x is the convolution of grad with the upstream [P, F] as filter, in grad that of x: both
    :class:`_PairSymmetricConv`, so every order is fused and differentiable."""

    @staticmethod
    def forward(ctx, x: Tensor, grad: Tensor, edge_index: Tensor) -> Tensor:
        ctx.save_for_backward(x, grad, edge_index)
        rows = edge_index.shape[1] // 2
        source = _FilterSource(x, filt=x.new_empty(rows, x.shape[1]))
        return _conv_backward(grad, x, edge_index, rows, source, (False, True, False))[1]

    @staticmethod
    def backward(ctx, up: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, grad, edge_index = ctx.saved_tensors
        need_x, need_grad, _ = ctx.needs_input_grad
        up = up.contiguous()
        grad_x = _PairSymmetricConv.apply(grad, edge_index, up) if need_x else None
        grad_grad = _PairSymmetricConv.apply(x, edge_index, up) if need_grad else None
        return grad_x, grad_grad, None


class _TableConv(torch.autograd.Function):
    """:func:`table_conv` by the fused kernels; the backward is :class:`_TableConvBackward`,
    so under ``create_graph`` (force training) it is differentiable again."""

    @staticmethod
    def forward(
        ctx, x: Tensor, edge_index: Tensor, dist: Tensor, edge_mask: Tensor,
        values: Tensor, slopes: Tensor, cutoff: float,
    ) -> Tensor:  # fmt: skip
        source = _FilterSource(x, table=(dist, edge_mask, values, slopes, cutoff))
        ctx.save_for_backward(x, edge_index, dist, edge_mask, values, slopes, source.spacing)
        return _conv_forward(x, edge_index, dist.shape[0], source)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        need_x, _, need_dist, _, need_values, need_slopes, _ = ctx.needs_input_grad
        needs = (need_x, need_values or need_slopes, need_dist)
        grad_x, grad_values, grad_slopes, grad_dist = _TableConvBackward.apply(
            grad, *ctx.saved_tensors, needs
        )
        grad_values = grad_values if need_values else None
        grad_slopes = grad_slopes if need_slopes else None
        return grad_x, None, grad_dist, None, grad_values, grad_slopes, None


class _TableConvBackward(torch.autograd.Function):
    """(grad_x, grad_values, grad_slopes, grad_dist) of :class:`_TableConv` by the fused
    backward kernel, None where ``needs`` = (x, table, dist) says so; its own backward is the
    fused double backward (:mod:`.triton_table_kernels`), differentiable once more only."""

    @staticmethod
    def forward(
        ctx, grad: Tensor, x: Tensor, edge_index: Tensor, dist: Tensor, edge_mask: Tensor,
        values: Tensor, slopes: Tensor, spacing: Tensor, needs: tuple[bool, bool, bool],
    ) -> tuple[Tensor | None, ...]:  # fmt: skip
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, x, edge_index, dist, edge_mask, values, slopes, spacing)
        grads = _kernels(x).fused_conv_backward(
            grad, x, edge_index, x, values, slopes, dist, edge_mask, spacing, dist.shape[0],
            True, *needs,
        )  # fmt: skip
        grad_x, _, grad_values, grad_slopes, grad_dist = grads
        need_x, need_table, need_dist = needs
        wanted = (need_x, need_table, need_table, need_dist)
        return _or_none((grad_x, grad_values, grad_slopes, grad_dist), wanted)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx, up_x: Tensor | None, up_values: Tensor | None, up_slopes: Tensor | None,
        up_dist: Tensor | None,
    ) -> tuple[Tensor | None, ...]:  # fmt: skip
        grad, x, edge_index, dist, edge_mask, values, slopes, spacing = ctx.saved_tensors
        _kernels(x)  # refuses tensors the kernels cannot run on
        from schnet_ipu.model.ops.triton_table_kernels import fused_table_double_backward

        need_grad, need_x, _, need_dist, _, need_values, need_slopes = ctx.needs_input_grad[:7]
        up_table = up_values is not None or up_slopes is not None
        if up_table:
            up_values, up_slopes = _or_zeros(up_values, values), _or_zeros(up_slopes, slopes)
        outputs = fused_table_double_backward(
            _or_zeros(up_x, x), values if up_values is None else up_values,
            slopes if up_slopes is None else up_slopes, _or_zeros(up_dist, dist),
            grad, x, edge_index, values, slopes, dist, edge_mask, spacing, up_table,
            need_grad, need_x, need_values or need_slopes, need_dist,
        )  # fmt: skip
        wanted = (need_grad, need_x, need_values, need_slopes, need_dist)
        out_grad, out_x, out_values, out_slopes, out_dist = _or_none(outputs, wanted)
        return out_grad, out_x, None, out_dist, None, out_values, out_slopes, None, None


def pair_symmetric_conv(x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
    """``out[i] = sum over edges (j -> i) of x[j] * filt[pair of the edge]``, fused.

    x [N, F]; edge_index [2, 2P] (forward pairs, then the same pairs reversed); filt [P, F]
    (cast to x's dtype, e.g. bf16 filters under autocast). Returns [N, F]. The torch
    flavour's :func:`~.torch_ops.pair_symmetric_conv` is the reference.
    """
    edge_index, filt = edge_index.contiguous(), filt.to(x.dtype).contiguous()
    return _PairSymmetricConv.apply(x.contiguous(), edge_index, filt)


def table_conv(
    x: Tensor, edge_index: Tensor, dist: Tensor, edge_mask: Tensor,
    values: Tensor, slopes: Tensor, cutoff: float,
) -> Tensor:  # fmt: skip
    """``out[i] = sum over edges (j -> i) of x[j] * W(d_ji)``, W interpolated from a table.

    The table of one interaction block holds ``values`` [K, F] = W(d_k) and ``slopes``
    [K, F] = dW/dd(d_k) on d_k = k h, h = cutoff / (K - 1). An edge of length d has
    s = d / h, k = clamp(floor(s), 0, K - 2), t = s - k and
    W = (2t^3 - 3t^2 + 1) v_k + (t^3 - 2t^2 + t) h s_k + (-2t^3 + 3t^2) v_{k+1}
    + (t^3 - t^2) h s_{k+1}; masked edges contribute nothing.

    x [N, F]; edge_index [2, E] (row 0 source j, row 1 receiver i); dist and edge_mask [E']
    with E' = E, or E' = E / 2 for pair-symmetric storage (edge p + E' is pair p reversed and
    shares its filter). Returns [N, F]; differentiable in x, dist, values and slopes, twice
    under ``create_graph`` (force training: the backward's own backward is a fused kernel too).
    """
    rows, edges = dist.shape[0], edge_index.shape[1]
    if edges not in (rows, 2 * rows):
        raise ValueError(f"table_conv: dist has {rows} rows for {edges} edges (need E or E/2)")
    return _TableConv.apply(
        x.contiguous(), edge_index.contiguous(), dist.to(x.dtype).contiguous(),
        edge_mask.to(torch.uint8).contiguous(),  # a copy: inductor cannot lower a bool view
        values.to(x.dtype).contiguous(), slopes.to(x.dtype).contiguous(), float(cutoff),
    )  # fmt: skip


class TritonOps(TorchOps):
    """The triton flavour: the torch flavour's primitives, with ``pair_symmetric_conv`` and
    ``table_conv`` fused (see the module docstring)."""

    name = "triton"
    pair_symmetric_conv = staticmethod(pair_symmetric_conv)
    table_conv = staticmethod(table_conv)

    def __init__(self) -> None:
        if not AVAILABLE:
            raise ConfigError(
                "model.ops=triton needs the triton package (pip install triton; it ships with "
                "torch's CUDA wheels); use model.ops=torch"
            )
        # imported now, before any torch.compile traces a model built with this flavour
        from schnet_ipu.model.ops import triton_kernels, triton_table_kernels  # noqa: F401
