"""What an op flavour is: the primitives SchNet is built from, as a ``typing.Protocol``.

Every flavour (:class:`~.torch_ops.TorchOps`, :class:`~.ipu_ops.IpuOps`,
:class:`~.triton_ops.TritonOps`) conforms by having these attributes; the model holds one as
``model.ops`` and calls nothing else. Shapes: N atoms, E edges (E = 2P for pair-symmetric
storage: forward pairs, then the same pairs reversed), F features, G molecule slots, K table
points.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Ops(Protocol):
    """The primitives of one op flavour (see the module docstring)."""

    name: str  # the ``model.ops`` value that selects the flavour

    def shifted_softplus(self, x: Tensor) -> Tensor:
        """``log1p(exp(-|x|)) + max(x, 0) - log 2``, any shape."""
        ...

    def gather(self, x: Tensor, index: Tensor) -> Tensor:
        """Rows of x [N, F] at index [E] -> [E, F]."""
        ...

    def scatter_sum(self, src: Tensor, index: Tensor, dim_size: int) -> Tensor:
        """Rows of src [E, F] (or [E]) summed by index [E] into [dim_size, F] (or
        [dim_size]); no ordering assumed."""
        ...

    def pair_symmetric_conv(self, x: Tensor, edge_index: Tensor, filt: Tensor) -> Tensor:
        """``scatter_sum(gather(x, src) * cat([filt, filt]), dst)`` for x [N, F],
        edge_index [2, 2P] (forward pairs, then reversed), filt [P, F] -> [N, F]."""
        ...

    def table_conv(
        self,
        x: Tensor,
        edge_index: Tensor,
        dist: Tensor,
        edge_mask: Tensor,
        values: Tensor,
        slopes: Tensor,
        cutoff: float,
    ) -> Tensor:
        """The same sum with each edge's filter interpolated (cubic Hermite) from a table of
        values and slopes [K, F] on [0, cutoff] (:mod:`schnet_ipu.model.filter_table`);
        dist and edge_mask [E'] with E' = E or E / 2 (pair-symmetric storage) -> [N, F].
        Differentiable in x, dist, values and slopes."""
        ...

    def knn_graph_packed(
        self, pos: Tensor, graph: Tensor, node_mask: Tensor, nodes_per_pack: int, k: int,
        cutoff: float,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The k nearest neighbours within the cutoff inside each pack -> (edge_index
        [2, N k], dist [N k], edge_mask [N k])."""
        ...

    def edge_distance(
        self,
        pos: Tensor,
        edge_index: Tensor,
        edge_mask: Tensor,
        cutoff: float,
        offset: Tensor | None = None,
    ) -> Tensor:
        """Edge lengths [E], masked ones at the cutoff; ``offset`` [E, 3] adds periodic
        images' cell offsets."""
        ...

    def cell_offsets(
        self, edge_shift: Tensor, cell: Tensor, graph: Tensor, receiver: Tensor
    ) -> Tensor:
        """``shift @ cell`` [E, 3] per periodic edge, from integer shifts [E, 3] and the cell
        [G, 3, 3] of the receiver's molecule slot."""
        ...
