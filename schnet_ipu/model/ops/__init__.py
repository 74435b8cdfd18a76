"""Op flavours: the primitives SchNet is built from, one module per kind of hardware.

The model calls only these primitives, through the flavour object it was built with
(``model.ops: torch | ipu``), so choosing a flavour never touches the model file:

* ``shifted_softplus(x)``: ``log1p(exp(-|x|)) + max(x, 0) - log 2``, any shape.
* ``gather(x, index)``: rows of x [N, F] at index [E] -> [E, F].
* ``scatter_sum(src, index, dim_size)``: rows of src [E, F] (or [E]) summed by index [E] into
  [dim_size, F] (or [dim_size]); no ordering assumed.
* ``pair_symmetric_conv(x, edge_index, filt)``: ``scatter_sum(gather(x, src) * cat([filt,
  filt]), dst)`` for x [N, F], edge_index [2, 2P] (forward pairs, then reversed), filt [P, F].
* ``table_conv(x, edge_index, dist, edge_mask, values, slopes, cutoff)``: the same sum with
  the filter of each edge interpolated (cubic Hermite) from a table of values and slopes
  [K, F] on [0, cutoff] (:mod:`schnet_ipu.model.filter_table`); dist/edge_mask [E'] with
  E' = E or E / 2 (pair-symmetric storage). Differentiable in x, dist, values and slopes.
* ``knn_graph_packed(pos, graph, node_mask, nodes_per_pack, k, cutoff)``: the k nearest
  neighbours within the cutoff inside each pack -> (edge_index [2, N k], dist [N k],
  edge_mask [N k]).
* ``edge_distance(pos, edge_index, edge_mask, cutoff, offset=None)``: edge lengths [E],
  masked ones at the cutoff; ``offset`` [E, 3] adds periodic images' cell offsets.
* ``cell_offsets(edge_shift, cell, graph, receiver)``: ``shift @ cell`` [E, 3] per periodic
  edge, from integer shifts [E, 3] and the cell [G, 3, 3] of the receiver's molecule slot.

Flavours: ``torch`` (:mod:`.torch_ops`: fused kernels, custom autograd, in-place buffers) for
CPU and CUDA; ``ipu`` (:mod:`.ipu_ops`: only ops PopTorch maps to Poplar) for the IPU and its
CPU emulation; ``triton`` (:mod:`.triton_ops`: the torch flavour with fused Triton kernels for
the message passing) for CUDA.
"""

from __future__ import annotations

from schnet_ipu.model.ops.common import naive_shifted_softplus
from schnet_ipu.model.ops.ipu_ops import IpuOps
from schnet_ipu.model.ops.torch_ops import TorchOps
from schnet_ipu.model.ops.triton_ops import TritonOps

FLAVOURS = {"torch": TorchOps, "ipu": IpuOps, "triton": TritonOps}

__all__ = ["FLAVOURS", "IpuOps", "TorchOps", "TritonOps", "get_ops", "naive_shifted_softplus"]


def get_ops(name: str) -> TorchOps | IpuOps:
    """The flavour called ``name`` ("torch", "ipu" or "triton")."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown op flavour {name!r}; one of {', '.join(FLAVOURS)}")
    return FLAVOURS[name]()
