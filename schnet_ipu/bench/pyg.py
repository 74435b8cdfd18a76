"""Stock PyG SchNet, the baseline of the throughput, model, loader, gpu and accuracy suites:
``torch_geometric.nn.models.SchNet`` on its ``DataLoader`` over our store's molecules, its
radius graph (torch-cluster's, not installed) in pure torch inside the timed step."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from schnet_ipu.config import ModelConfig
from schnet_ipu.data import radius_edges
from schnet_ipu.task import masked_mse
from schnet_ipu.training.data import PreparedData

NAME = "stock PyG SchNet"
RADIUS_BUILDER = "schnet_ipu.data.radius_edges (pure torch, inside the timed step)"


def with_lengths(edge_index: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a PyG ``interaction_graph`` returns: ``edge_index`` and the edges' lengths."""
    return edge_index, (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)


def items(data: PreparedData, split: str = "train", limit: int | None = None) -> list:
    """A split's molecules (up to ``limit``) as PyG ``Data``: z, pos, y (less atom references)."""
    from torch_geometric.data import Data

    rows = []
    for index in data.split[split][:limit].tolist():
        z, pos = data.store.molecule(index)
        y = torch.tensor([data.targets[index]], dtype=torch.float32)
        rows.append(Data(z=torch.from_numpy(z.astype(np.int64)), pos=torch.from_numpy(pos), y=y))
    return rows


def schnet(size: ModelConfig, interaction_graph: Callable | None = None, **extra):
    """PyG's SchNet of our size (``extra``: e.g. ``mean``), by default on ``RADIUS_BUILDER``."""
    from torch_geometric.nn.models import SchNet

    def radius_graph(pos: torch.Tensor, batch: torch.Tensor):
        return with_lengths(radius_edges(pos, size.cutoff, batch), pos)

    graph = interaction_graph or radius_graph
    return SchNet(size.hidden_channels, size.num_filters, size.num_interactions,
                  size.num_gaussians, size.cutoff, interaction_graph=graph, **extra)  # fmt: skip


class Trainer:
    """Stock PyG SchNet of our size, Adam 1e-3 and our standardised loss on shuffled batches."""

    def __init__(
        self, data: PreparedData, size: ModelConfig, batch_size: int = 32, device: str = "cpu",
        train_items: list | None = None, scale: float | None = None, **extra: float,
    ) -> None:  # fmt: skip
        from torch_geometric.loader import DataLoader

        loader = DataLoader(train_items or items(data), batch_size=batch_size, shuffle=True)
        torch.manual_seed(0)
        self.model = schnet(size, **extra).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.scale = data.residual_std if scale is None else scale
        # reshuffled each epoch
        self.batches = (batch.to(device) for _ in itertools.count() for batch in loader)

    def step(self) -> int:
        """One training step on the next batch: its molecules (a timer step)."""
        batch = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        pred = self.model(batch.z, batch.pos, batch.batch).view(-1)
        masked_mse(pred, batch.y, torch.ones_like(batch.y, dtype=torch.bool), self.scale).backward()
        self.optimizer.step()
        return batch.num_graphs


def mae(model: torch.nn.Module, rows: list) -> float:
    """Mean absolute error of ``model`` on ``rows`` (PyG ``Data``), batches of 128."""
    from torch_geometric.loader import DataLoader

    model.eval()
    with torch.no_grad():
        errors = [(model(b.z, b.pos, b.batch) - b.y.view(-1, 1)).abs()
                  for b in DataLoader(rows, batch_size=128)]  # fmt: skip
    model.train()
    return float(torch.cat(errors).mean())
