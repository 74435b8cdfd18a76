"""SchNet on packed fixed-shape batches (see :mod:`schnet_ipu.batch` for the layout).

The model computes the SchNet of `"SchNet: A Continuous-filter Convolutional Neural Network for
Modeling Quantum Interactions" <https://arxiv.org/abs/1706.08566>`_ exactly as PyTorch
Geometric's ``torch_geometric.nn.models.SchNet`` does, with the same parameter names, so a PyG
state dict loads unchanged. What differs is how the work is laid out:

* the Gaussian expansion and cosine cutoff are computed once and shared by every block;
* on radius graphs with ``pair_symmetric=True`` the filter is computed once per unordered
  pair and shared by both directions (the batch stores the reversed pairs in the same order);
* messages are gathered and summed by the op flavour's primitives (``model.ops``: ``torch``
  uses 1-D ``index_add_``, ``ipu`` only ops PopTorch maps; see :mod:`schnet_ipu.model.ops`)
  or, on knn graphs whose receivers are sorted with k edges each, by a reshape and a sum;
* k-nearest-neighbour graphs are searched on the device inside each pack;
* ``message_passing="dense"`` swaps the edge list for one [M, M] block of pairs per pack
  (:mod:`schnet_ipu.model.dense`): the same filters and masks, no gather or scatter;
* ``filter="table"`` evaluates every block's filter network on a grid of ``filter_points``
  distances once per forward pass (all blocks in one batched pass) and interpolates it per
  edge (cubic Hermite, C^1: :mod:`schnet_ipu.model.filter_table`), summed by the flavour's
  ``table_conv``; the same parameters, so a state dict moves freely between ``exact`` and
  ``table``;
* padding atoms, edges and molecule slots are inert: they never reach a real molecule's
  prediction or its gradient.

The layers (softplus, Gaussians, CFConv, interaction block) are :mod:`schnet_ipu.model.blocks`'s;
this module assembles them and chooses the graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import Embedding, Linear, ModuleList

from schnet_ipu.batch import Batch
from schnet_ipu.config import ModelConfig
from schnet_ipu.model.blocks import (
    ExactEdges,
    GaussianSmearing,
    InteractionBlock,
    ShiftedSoftplus,
    TabulatedEdges,
    full_precision,
)
from schnet_ipu.model.dense import dense_graph
from schnet_ipu.model.filter_table import filter_tables
from schnet_ipu.model.ops import get_ops

EMBEDDING_ROWS = 100  # rows of the atom embedding and atomref (PyG's 100); row 0: padding atom


class SchNet(nn.Module):
    """SchNet for :class:`~schnet_ipu.batch.Batch` inputs.

    Args:
        hidden_channels: atom feature width H.
        num_filters: filter width F.
        num_interactions: interaction blocks I.
        num_gaussians: radial basis functions on 0..cutoff.
        cutoff: interaction cutoff in Angstrom (cosine cutoff).
        graph: ``"knn"`` (k nearest within the cutoff, searched per pack on the device) or
            ``"radius"`` (``batch.edge_index`` / ``batch.edge_mask``).
        k: neighbours per atom for ``graph="knn"``.
        readout: ``"sum"`` or ``"mean"`` (over the real atoms of a molecule).
        pair_symmetric: radius graphs only: compute one filter per unordered pair (the first
            E/2 edges) and reuse it for the reversed half. Exact. Ignored for knn graphs.
        filter: ``"exact"`` (the filter network per edge) or ``"table"`` (per block, once per
            forward pass, on ``filter_points`` grid distances, interpolated per edge).
        filter_points: K, the grid points of ``filter="table"`` (>= 2).
        stable_softplus: False swaps in the naive ``log(1 + exp(x)) - log 2`` (ablation).
        ops: the op flavour, ``"torch"`` (CPU, CUDA) or ``"ipu"`` (only ops PopTorch maps).
        max_nodes_per_pack: atoms per pack M; needed for ``graph="knn"`` and dense.
        message_passing: ``"sparse"`` (edge lists) or ``"dense"`` ([M, M] pair blocks per
            pack, found from the positions; the same model, see :mod:`.dense`).
        mean, std: the per-atom output is ``h * std + mean`` (target standardisation).
        atomref: optional per-element reference values [Z] or [Z, 1], added per atom; the first
            100 rows are used (missing rows are zero), as a trainable embedding like PyG's.

    ``forward(batch)`` returns [G] predictions in target units (0 for padding slots).
    """

    def __init__(
        self,
        hidden_channels: int = 100,
        num_filters: int = 100,
        num_interactions: int = 4,
        num_gaussians: int = 25,
        cutoff: float = 6.0,
        graph: str = "knn",
        k: int = 24,
        readout: str = "sum",
        pair_symmetric: bool = True,
        stable_softplus: bool = True,
        ops: str = "torch",
        max_nodes_per_pack: int | None = None,
        mean: float = 0.0,
        std: float = 1.0,
        atomref: Tensor | None = None,
        message_passing: str = "sparse",
        filter: str = "exact",
        filter_points: int = 256,
    ):
        super().__init__()
        if filter not in ("exact", "table"):
            raise ValueError(f"filter must be 'exact' or 'table', got {filter!r}")
        if filter_points < 2:
            raise ValueError(f"filter_points must be >= 2, got {filter_points}")
        if graph not in ("knn", "radius"):
            raise ValueError(f"graph must be 'knn' or 'radius', got {graph!r}")
        if readout not in ("sum", "mean"):
            raise ValueError(f"readout must be 'sum' or 'mean', got {readout!r}")
        if graph == "knn" and not max_nodes_per_pack:
            raise ValueError("graph='knn' searches neighbours per pack: pass max_nodes_per_pack")
        if message_passing not in ("sparse", "dense"):
            raise ValueError(f"message_passing must be 'sparse' or 'dense': {message_passing!r}")
        if message_passing == "dense" and not max_nodes_per_pack:
            raise ValueError("dense message passing works per pack: pass max_nodes_per_pack")
        self.hidden_channels = hidden_channels
        self.num_filters = num_filters
        self.num_interactions = num_interactions
        self.num_gaussians = num_gaussians
        self.cutoff = cutoff
        self.graph = graph
        self.k = k
        self.readout = readout
        self.pair_symmetric = pair_symmetric
        self.max_nodes_per_pack = max_nodes_per_pack
        self.message_passing = message_passing
        self.filter = filter
        self.filter_points = filter_points
        self.mean = mean
        self.std = std
        self.ops = get_ops(ops)

        self.embedding = Embedding(EMBEDDING_ROWS, hidden_channels, padding_idx=0)
        self.distance_expansion = GaussianSmearing(0.0, cutoff, num_gaussians)
        self.interactions = ModuleList(
            InteractionBlock(hidden_channels, num_gaussians, num_filters, self.ops, stable_softplus)
            for _ in range(num_interactions)
        )
        self.lin1 = Linear(hidden_channels, hidden_channels // 2)
        self.act = ShiftedSoftplus(self.ops, stable_softplus)
        self.lin2 = Linear(hidden_channels // 2, 1)

        self.atomref = None
        if atomref is not None:
            ref = torch.zeros(EMBEDDING_ROWS, 1)
            rows = torch.as_tensor(atomref, dtype=torch.float32).reshape(-1)[:EMBEDDING_ROWS]
            ref[: rows.numel(), 0] = rows
            self.register_buffer("initial_atomref", ref)
            self.atomref = Embedding(EMBEDDING_ROWS, 1)
        self.reset_parameters()

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        max_nodes_per_pack: int | None,
        mean: float = 0.0,
        std: float = 1.0,
        atomref: Tensor | None = None,
    ) -> SchNet:
        """Build from the ``model`` section of the config plus data-derived values."""
        return cls(
            hidden_channels=model_cfg.hidden_channels,
            num_filters=model_cfg.num_filters,
            num_interactions=model_cfg.num_interactions,
            num_gaussians=model_cfg.num_gaussians,
            cutoff=model_cfg.cutoff,
            graph=model_cfg.graph,
            k=model_cfg.k,
            readout=model_cfg.readout,
            pair_symmetric=model_cfg.pair_symmetric,
            stable_softplus=model_cfg.stable_softplus,
            ops=model_cfg.ops,
            max_nodes_per_pack=max_nodes_per_pack,
            mean=mean,
            std=std,
            atomref=atomref,
            message_passing=model_cfg.message_passing,
            filter=model_cfg.filter,
            filter_points=model_cfg.filter_points,
        )

    def reset_parameters(self) -> None:
        """Re-initialise every learnable parameter (PyG's initialisation)."""
        self.embedding.reset_parameters()
        for interaction in self.interactions:
            interaction.reset_parameters()
        nn.init.xavier_uniform_(self.lin1.weight)
        self.lin1.bias.data.fill_(0)
        nn.init.xavier_uniform_(self.lin2.weight)
        self.lin2.bias.data.fill_(0)
        if self.atomref is not None:
            self.atomref.weight.data.copy_(self.initial_atomref)

    def interaction_graph(
        self, batch: Batch, forward_pairs: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``edge_index`` [2, E], distances [E'] and ``edge_mask`` [E'] for the configured graph.

        knn: E = N * k, masked edges are self loops at the cutoff distance. radius: the
        batch's edges (forward pairs, then the same pairs reversed), masked ones at the cutoff;
        on periodic batches (``edge_shift`` and ``cell``) each edge reaches the image
        ``pos[j] + shift @ cell``.
        E' = E, or E / 2 with ``forward_pairs`` (radius only): the forward pairs alone, which
        is all a pair-symmetric filter needs.
        """
        if self.graph == "knn":
            if batch.cell is not None:
                raise ValueError("periodic batches need graph='radius' (knn ignores the cell)")
            return self.ops.knn_graph_packed(
                batch.pos,
                batch.graph,
                batch.node_mask,
                self.max_nodes_per_pack,
                self.k,
                self.cutoff,
            )
        if batch.edge_index is None or batch.edge_mask is None:
            raise ValueError("graph='radius' needs a batch with edge_index and edge_mask")
        edge_index, edge_mask = batch.edge_index, batch.edge_mask
        if forward_pairs:
            edge_mask = edge_mask[: edge_index.shape[1] // 2]
        pairs = edge_index[:, : len(edge_mask)]
        offset = None
        if batch.edge_shift is not None and batch.cell is not None:
            shift = batch.edge_shift[: len(edge_mask)]
            offset = self.ops.cell_offsets(shift, batch.cell, batch.graph, pairs[1])
        dist = self.ops.edge_distance(batch.pos, pairs, edge_mask, self.cutoff, offset)
        return edge_index, dist, edge_mask

    def edge_features(self, dist: Tensor, edge_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Gaussian expansion [E, G] and cosine cutoff [E] (zero on masked edges) of ``dist``
        [E] (or any shape, e.g. dense [B, M, M]), shared by every interaction block."""
        cut = 0.5 * (torch.cos(dist * (math.pi / self.cutoff)) + 1.0)
        return self.distance_expansion(dist), torch.where(edge_mask, cut, 0.0)

    def forward(self, batch: Batch) -> Tensor:
        """Predictions [G] in target units for the G molecule slots of ``batch``."""
        num_nodes, num_graphs = batch.num_nodes, batch.num_graphs
        knn = self.k if self.graph == "knn" else None
        if self.message_passing == "dense":
            if batch.cell is not None:
                raise ValueError("periodic batches need message_passing='sparse'")
            edge_index = None  # pair blocks [B, M, M] instead of edges
            dist, edge_mask = dense_graph(batch, self.max_nodes_per_pack, self.cutoff, knn)
        else:
            pair_symmetric = self.graph == "radius" and self.pair_symmetric
            edge_index, dist, edge_mask = self.interaction_graph(batch, pair_symmetric)
        block_edges: list[ExactEdges] | list[TabulatedEdges]
        if self.filter == "table":
            mlps = [interaction.mlp for interaction in self.interactions]
            with full_precision(dist):  # bf16 tables would be rounded, and cost little less
                values, slopes = filter_tables(  # [B, K, F]
                    mlps, self.distance_expansion, self.cutoff, self.filter_points
                )
            block_edges = [  # unbind's backward is one stack; a select's zero-fills [B, K, F]
                TabulatedEdges(dist, edge_mask, block_values, block_slopes, self.cutoff)
                for block_values, block_slopes in zip(values.unbind(0), slopes.unbind(0))
            ]
        else:
            shared = ExactEdges(*self.edge_features(dist, edge_mask))  # one for every block
            block_edges = [shared] * len(self.interactions)

        h = self.embedding(batch.z)  # [N, H]
        for interaction, edges in zip(self.interactions, block_edges):
            h = h + interaction(h, edge_index, edges, knn)

        with full_precision(h):  # [N]: atom energies in fp32, as their sum
            out = self.lin2(self.act(self.lin1(h))).view(num_nodes)
        out = out * self.std + self.mean
        if self.atomref is not None:
            out = out + self.atomref(batch.z).view(num_nodes)
        # padding atoms belong to the filler slot G, which is dropped
        pred = self.ops.scatter_sum(out, batch.graph, num_graphs + 1)[:num_graphs]
        if self.readout == "mean":
            mask = batch.node_mask.to(out.dtype)
            count = self.ops.scatter_sum(mask, batch.graph, num_graphs + 1)
            pred = pred / count[:num_graphs].clamp(min=1.0)
        return pred

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(hidden_channels={self.hidden_channels}, "
            f"num_filters={self.num_filters}, num_interactions={self.num_interactions}, "
            f"num_gaussians={self.num_gaussians}, cutoff={self.cutoff}, graph={self.graph!r}, "
            f"k={self.k}, readout={self.readout!r}, pair_symmetric={self.pair_symmetric}, "
            f"ops={self.ops.name!r}, message_passing={self.message_passing!r}, "
            f"filter={self.filter!r}, filter_points={self.filter_points})"
        )
