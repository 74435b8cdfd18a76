"""The fixed-shape batch: the one data structure shared by loader, model, backends and trainer.

A batch holds B packs. Each pack has room for ``max_nodes`` atoms and ``max_graphs``
molecules (and ``max_edges`` directed edges for radius graphs), so every batch of a run has
the same shapes:

    N = B * max_nodes     atoms, pack p owns rows [p * max_nodes, (p + 1) * max_nodes)
    G = B * max_graphs    molecule slots, pack p owns slots [p * max_graphs, (p + 1) * max_graphs)
    E = B * max_edges     directed edges (radius graphs only)

Padding conventions (the model and loss rely on them; tests check them):

* A padding atom has ``z == 0``, ``node_mask == False`` and ``graph == G``: it belongs to the
  filler graph one past the last real slot. Readouts allocate ``G + 1`` rows and drop the last.
  Padding atoms sit far apart from each other and from every real atom (further than any
  cutoff), so no neighbour search can pair them with anything.
* A padding molecule slot has ``graph_mask == False`` and ``molecule_index == -1``. Its target
  is arbitrary: losses are masked with ``graph_mask``, never by testing ``y == 0``.
* Radius graphs: ``edge_index[:, : E // 2]`` holds each unordered pair once (source < target
  within a molecule) and ``edge_index[:, E // 2 :]`` holds the same pairs reversed, in the same
  order, so a filter computed on the first half serves both directions. A padding edge has
  ``edge_mask == False`` and joins a padding atom to itself (or atom 0 to itself when the batch
  has no padding atom); its message is multiplied by zero.
* Periodic batches (stores with cells) also carry ``edge_shift`` [E, 3] int32 and ``cell``
  [G, 3, 3] float32 (rows are lattice vectors; zeros on padding slots and molecules). Edge e
  from atom ``s = edge_index[0, e]`` to ``r = edge_index[1, e]`` is the vector
  ``pos[r] - pos[s] + edge_shift[e] @ cell[slot of r]``. A forward pair (i, j, S) has its
  reverse (j, i, -S) in the second half, so the radius layout and the pair-symmetric filter
  hold unchanged; an atom may pair with its own image (i == j, S != 0), and with several
  images of one neighbour. Molecule batches have both fields None (unchanged bits).
* Partial labels (stores where only some frames carry forces or stress): ``forces_mask``
  / ``stress_mask`` [G] bool say which slots' frames carry them (False on padding slots);
  the others hold zero targets that no loss or metric reads. Batches of fully labelled
  stores have both None: every real slot carries the forces, every slot with a cell the
  stress.
* Atoms of one molecule are contiguous and molecules keep their pack, so ``graph`` is sorted
  (non-decreasing) over the real atoms of each pack.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


@dataclass
class Batch:
    """B packs collated into fixed-shape tensors (see the module docstring for the layout)."""

    z: Tensor  # [N] int64 atomic numbers, 0 for padding atoms
    pos: Tensor  # [N, 3] float32 positions in Angstrom
    graph: Tensor  # [N] int64 molecule slot of each atom in [0, G]; G is the filler graph
    node_mask: Tensor  # [N] bool, True for real atoms
    y: Tensor  # [G] float32 regression target per molecule slot
    graph_mask: Tensor  # [G] bool, True for real molecules
    molecule_index: Tensor  # [G] int64 index of the molecule in the store, -1 for padding
    edge_index: Tensor | None = None  # [2, E] int64, radius graphs only
    edge_mask: Tensor | None = None  # [E] bool, radius graphs only
    forces: Tensor | None = None  # [N, 3] float32 target forces, 0 on padding; stores with forces
    edge_shift: Tensor | None = None  # [E, 3] int32 integer cell shifts; periodic batches only
    cell: Tensor | None = None  # [G, 3, 3] float32 lattice vectors as rows; periodic batches only
    stress: Tensor | None = None  # [G, 3, 3] float32 target stress, 0 on padding; stores with it
    forces_mask: Tensor | None = None  # [G] bool frame carries forces; partial forces only
    stress_mask: Tensor | None = None  # [G] bool frame carries stress; partial stress only

    @property
    def num_nodes(self) -> int:
        return self.z.shape[0]

    @property
    def num_graphs(self) -> int:
        return self.y.shape[0]

    # int | None: real molecules as the loader counted them on the host; None: counted from
    # graph_mask, which waits for a GPU. Unannotated, so not a field (the fields are tensors).
    known_molecules = None

    @property
    def num_molecules(self) -> int:
        """Real molecules in the batch (no device sync when the loader counted them)."""
        if self.known_molecules is not None:
            return self.known_molecules
        return int(self.graph_mask.sum())

    def signature(self) -> tuple:
        """Shapes and dtypes of every tensor: equal signatures mean no recompilation."""
        return tuple(
            (f.name, None if t is None else (tuple(t.shape), t.dtype))
            for f in fields(self)
            for t in [getattr(self, f.name)]
        )

    def as_tuple(self) -> tuple[Tensor, ...]:
        """The tensors in field order, without the absent edge fields (for PopTorch)."""
        return tuple(t for f in fields(self) if (t := getattr(self, f.name)) is not None)

    def present_fields(self) -> tuple[str, ...]:
        """Names of the fields :meth:`as_tuple` returns, in its order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)

    @classmethod
    def from_tuple(cls, tensors: tuple[Tensor, ...], names: tuple[str, ...]) -> Batch:
        """Inverse of :meth:`as_tuple`, given the :meth:`present_fields` of the batch."""
        return cls(**dict(zip(names, tensors)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch in pinned host memory, for non-blocking copies to CUDA; a batch already
        pinned, or on a device (device-resident data), is returned as it is."""
        if self.z.device.type != "cpu" or self.z.is_pinned():
            return self
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> Batch:
        mapped = replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )
        mapped.known_molecules = self.known_molecules
        return mapped


def stack_batches(batches: list[Batch]) -> Batch:
    """Concatenate micro-batches into one larger batch (graph ids and edges re-offset).

    Shapes: each input has N, G, E; the result has len(batches) times each. Used to build
    the reference "one process on the concatenated batch" in replication tests and to
    evaluate several micro-batches at once.
    """
    node_offset = 0
    graph_offset = 0
    total_graphs = sum(b.num_graphs for b in batches)
    graphs, edges = [], []
    for b in batches:
        real = b.graph < b.num_graphs
        filler = torch.full_like(b.graph, total_graphs)
        graphs.append(torch.where(real, b.graph + graph_offset, filler))
        if b.edge_index is not None:
            edges.append(b.edge_index + node_offset)
        node_offset += b.num_nodes
        graph_offset += b.num_graphs

    def cat(name: str) -> Tensor:
        return torch.cat([getattr(b, name) for b in batches])

    def cat_present(name: str) -> Tensor | None:
        return cat(name) if all(getattr(b, name) is not None for b in batches) else None

    edge_index = edge_mask = edge_shift = None
    if edges:
        halves = [e.shape[1] // 2 for e in edges]
        forward = torch.cat([e[:, :h] for e, h in zip(edges, halves)], dim=1)
        edge_index = torch.cat([forward, forward.flip(0)], dim=1)
        masks = [b.edge_mask for b in batches]
        edge_mask = torch.cat([torch.cat([m[:h] for m, h in zip(masks, halves)])] * 2)
        if all(b.edge_shift is not None for b in batches):
            shifts = torch.cat([b.edge_shift[:h] for b, h in zip(batches, halves)])
            edge_shift = torch.cat([shifts, -shifts])
    return Batch(
        z=cat("z"),
        pos=cat("pos"),
        graph=torch.cat(graphs),
        node_mask=cat("node_mask"),
        y=cat("y"),
        graph_mask=cat("graph_mask"),
        molecule_index=cat("molecule_index"),
        edge_index=edge_index,
        edge_mask=edge_mask,
        forces=cat_present("forces"),
        edge_shift=edge_shift,
        cell=cat_present("cell"),
        stress=cat_present("stress"),
        forces_mask=cat_present("forces_mask"),
        stress_mask=cat_present("stress_mask"),
    )
