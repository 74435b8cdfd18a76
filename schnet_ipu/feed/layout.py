"""The batch layout the feed builds to: shapes of every batch, this replica's share, and
where padding atoms sit. The floor under the feed: the arrays, the assembly, the collate
and the loader all read it, and it reads nothing of theirs.

See :mod:`schnet_ipu.batch` for what the shapes hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from schnet_ipu.errors import UserError
from schnet_ipu.packing import PackPlan

PADDING_SPACING = 100.0  # Angstrom between padding atoms; far beyond any cutoff
PADDING_ORIGIN = 1000.0  # Angstrom; padding atoms sit on a line starting here


class LoaderError(UserError, RuntimeError):
    """A batch could not be built or changed shape mid-run."""


@dataclass(frozen=True)
class Layout:
    """How micro-batches are shaped and shared out.

    Shapes of every batch: N = packs_per_batch * max_nodes atoms, G = packs_per_batch *
    max_graphs slots, E = packs_per_batch * max_edges edges (radius graphs only: the
    pairs within ``cutoff``).
    """

    packs_per_batch: int
    max_nodes: int
    max_graphs: int
    max_edges: int | None = None  # directed edges per pack; None for knn graphs
    cutoff: float | None = None  # Angstrom; radius graphs (with max_edges) only
    micro_per_call: int = 1  # device_iterations x gradient_accumulation
    replicas: int = 1
    replica: int = 0
    replica_balance: str = "none"  # cost_model: like-cost micro-batches share a step

    def __post_init__(self) -> None:
        if (self.max_edges is None) != (self.cutoff is None):
            raise ValueError("a radius-graph layout needs both max_edges and cutoff, knn neither")

    @classmethod
    def from_plan(
        cls, plan: PackPlan, packs_per_batch: int, cutoff: float | None, **share
    ) -> Layout:
        """Shapes of ``plan``; ``cutoff`` for radius graphs, None for knn graphs."""
        return cls(
            packs_per_batch=packs_per_batch,
            max_nodes=plan.max_nodes,
            max_graphs=plan.max_graphs,
            max_edges=None if cutoff is None else plan.max_edges,
            cutoff=cutoff,
            **share,
        )

    def batch_bytes(
        self, forces: bool = False, periodic: bool = False, stress: bool = False, masks: int = 0
    ) -> int:
        """Bytes of one assembled batch (N, G, E as above); ``periodic``: with cells and
        edge shifts; ``stress``: with target stress; ``masks``: per-slot label masks."""
        n = self.packs_per_batch * self.max_nodes
        g = self.packs_per_batch * self.max_graphs
        e = self.packs_per_batch * (self.max_edges or 0)
        cells, shifts = (36, 12) if periodic else (0, 0)
        return (
            n * (8 + 12 + 8 + 1 + (12 if forces else 0))
            + g * (4 + 1 + 8 + cells + (36 if stress else 0) + masks)
            + e * (16 + 1 + shifts)
        )
