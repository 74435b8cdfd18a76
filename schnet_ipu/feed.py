"""Batches as array programs: many fixed-shape batches from a few gathers over flat arrays.

:class:`FeedArrays` holds a split's source data flat, as torch tensors on one device (CPU,
or the training device when the data is device-resident): the store's concatenated atoms,
per-molecule offsets, targets and, for radius graphs, the pairs file's pairs.
:func:`assemble` turns K batches worth of packs, given flat (molecules in pack order, pack
lengths), into [K, ...] tensors with no Python loop over molecules or packs; the loader
hands out their rows as :class:`~schnet_ipu.batch.Batch` views.

Radius edges keep the order of a per-pack search: pack, then i, then j (i < j), forward
pairs first, then the same pairs reversed (see schnet_ipu.batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.pairs import RadiusPairs
from schnet_ipu.errors import UserError

if TYPE_CHECKING:
    from schnet_ipu.loader import Layout

PADDING_SPACING = 100.0  # Angstrom between padding atoms; far beyond any cutoff
PADDING_ORIGIN = 1000.0  # Angstrom; padding atoms sit on a line starting here


class LoaderError(UserError, RuntimeError):
    """A batch could not be built or changed shape mid-run."""


@dataclass
class FeedArrays:
    """Flat source arrays of M molecules and A atoms (P radius pairs), all on ``device``."""

    z: Tensor  # uint8 [A] atomic numbers
    pos: Tensor  # float32 [A, 3]
    forces: Tensor | None  # float32 [A, 3], stores with forces only
    atom_start: Tensor  # int64 [M] first atom of each molecule
    num_atoms: Tensor  # int64 [M]
    y: Tensor  # float32 [M] targets
    pair_i: Tensor | None  # uint8 (or wider) [P] local first atom, radius graphs only
    pair_j: Tensor | None  # [P] local second atom, j > i
    pair_start: Tensor | None  # int64 [M] first pair of each molecule
    pair_count: Tensor | None  # int64 [M]
    ids: np.ndarray  # int64 [M] record ids, for error messages
    source: str  # where the molecules come from, for error messages
    store_index: Tensor | None = None  # int64 [M] molecule_index of each; None: 0..M-1

    @classmethod
    def from_store(
        cls, store: MoleculeStore, targets: np.ndarray, pairs: RadiusPairs | None, device="cpu"
    ) -> FeedArrays:
        """The whole store (``targets`` [M]), on ``device``; ``pairs``: the store's radius
        pairs (:func:`~schnet_ipu.data.pairs.radius_pairs`) for radius graphs, else None."""
        try:
            z, pos = store.concatenated()
            forces = store.forces() if store.has_forces else None
        except OSError as err:
            raise LoaderError(f"cannot read the molecules of {store.path}: {err}") from err
        arrays = cls.build(
            z, pos, forces, store.offsets, targets, pairs, store.ids, str(store.path)
        )
        return arrays.to(device)

    @classmethod
    def build(
        cls,
        z: np.ndarray,
        pos: np.ndarray,
        forces: np.ndarray | None,
        offsets: np.ndarray,
        targets: np.ndarray,
        pairs: RadiusPairs | None,
        ids: np.ndarray,
        source: str,
        store_index: np.ndarray | None = None,
    ) -> FeedArrays:
        """CPU feed arrays from numpy: ``offsets`` int [M + 1] splits z [A] / pos [A, 3]."""
        offsets = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        pair_offsets = None if pairs is None else torch.from_numpy(pairs.offsets)
        return cls(
            z=torch.from_numpy(np.asarray(z, dtype=np.uint8)),
            pos=torch.from_numpy(np.asarray(pos, dtype=np.float32)),
            forces=None if forces is None else torch.from_numpy(forces),
            atom_start=offsets[:-1],
            num_atoms=offsets.diff(),
            y=torch.from_numpy(np.asarray(targets)).to(torch.float32),
            pair_i=None if pairs is None else torch.from_numpy(pairs.i),
            pair_j=None if pairs is None else torch.from_numpy(pairs.j),
            pair_start=None if pairs is None else pair_offsets[:-1],
            pair_count=None if pairs is None else pair_offsets.diff(),
            ids=np.asarray(ids, dtype=np.int64),
            source=source,
            store_index=None if store_index is None else torch.as_tensor(store_index),
        )

    def to(self, device: torch.device | str) -> FeedArrays:
        moved = {
            name: value.to(device) if isinstance(value, Tensor) else value
            for name, value in self.__dict__.items()
        }
        return FeedArrays(**moved)

    @property
    def device(self) -> torch.device:
        return self.pos.device

    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for v in self.__dict__.values() if isinstance(v, Tensor)
        )

    def name(self, molecule: int) -> str:
        return f"molecule {molecule} (record {int(self.ids[molecule])}) of {self.source}"


@dataclass
class Assembled:
    """K batches as stacked tensors; row k of every field is batch k (shapes of Batch)."""

    z: Tensor  # int64 [K, N]
    pos: Tensor  # float32 [K, N, 3]
    graph: Tensor  # int64 [K, N]
    node_mask: Tensor  # bool [K, N]
    y: Tensor  # float32 [K, G]
    graph_mask: Tensor  # bool [K, G]
    molecule_index: Tensor  # int64 [K, G]
    edge_index: Tensor | None  # int64 [K, 2, E]
    edge_mask: Tensor | None  # bool [K, E]
    forces: Tensor | None  # float32 [K, N, 3]


def _exclusive_cumsum(counts: Tensor) -> Tensor:
    return counts.cumsum(0) - counts


def _spread(counts: Tensor) -> tuple[Tensor, Tensor]:
    """For segments of ``counts`` [S] items: (segment of each item, rank inside it), [sum]."""
    total = int(counts.sum())
    segment = torch.repeat_interleave(
        torch.arange(len(counts), device=counts.device), counts, output_size=total
    )
    rank = torch.arange(total, device=counts.device) - _exclusive_cumsum(counts)[segment]
    return segment, rank


class _Items:
    """Items of S segments laid end to end (``counts`` [S] each): per-item values in one
    pass each, no per-item segment lookups."""

    def __init__(self, counts: Tensor) -> None:
        self.counts = counts
        self.total = int(counts.sum())
        self.first = _exclusive_cumsum(counts)
        self.index = torch.arange(self.total, device=counts.device)

    def repeat(self, values: Tensor) -> Tensor:
        """values [S] -> [total]: each segment's value on each of its items."""
        return torch.repeat_interleave(values, self.counts, output_size=self.total)

    def ranges(self, starts: Tensor) -> Tensor:
        """starts [S] -> [total]: ``starts[s] + rank`` for the items of segment s."""
        return self.repeat(starts - self.first) + self.index


def assemble(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor, pin: bool = False
) -> Assembled:
    """K batches from packs given flat: ``molecules`` int64 [T] indices into ``arrays`` in
    pack order, ``pack_lengths`` int64 [K * B] molecules per pack (0 = an empty pack).

    Raises LoaderError naming the molecule (index and record id) when one molecule exceeds the
    pack's atom or edge limit, or the pack when its molecules together do. ``pin``: allocate
    the CPU outputs in pinned memory (for non-blocking copies to CUDA).
    """
    lay, dev = layout, arrays.device
    B, size, slots = lay.packs_per_batch, lay.max_nodes, lay.max_graphs
    K = len(pack_lengths) // B
    N, G = B * size, B * slots
    pack, slot = _spread(pack_lengths)  # [T] flat pack (k * B + p) and slot of each molecule
    n = arrays.num_atoms[molecules]
    first_atom = _exclusive_cumsum(n)
    atom_offset = first_atom - first_atom[_exclusive_cumsum(pack_lengths)[pack]]
    _check_fits(arrays, layout, molecules, pack, slot, n, atom_offset + n, len(pack_lengths))

    def empty(shape, dtype, fill=None) -> Tensor:
        out = torch.empty(shape, dtype=dtype, device=dev, pin_memory=pin and dev.type == "cpu")
        return out if fill is None else out.fill_(fill)

    atoms = _Items(n)
    src = atoms.ranges(arrays.atom_start[molecules])
    row = atoms.ranges(pack * size + atom_offset)  # flat over K * N
    z = empty((K * N,), torch.int64, 0)
    z[row] = arrays.z[src].long()
    pos = empty((K * N, 3), torch.float32, 0)
    pos[row] = arrays.pos[src]
    graph = empty((K * N,), torch.int64, G)
    graph[row] = atoms.repeat(pack % B * slots + slot)  # batch-local slot
    node_mask = (graph < G).view(K, N)
    padding = ~node_mask
    padding_x = PADDING_ORIGIN + PADDING_SPACING * (padding.cumsum(1) - 1)
    pos = pos.view(K, N, 3)
    pos[..., 0] = torch.where(node_mask, pos[..., 0], padding_x)
    forces = None
    if arrays.forces is not None:
        forces = empty((K * N, 3), torch.float32, 0)
        forces[row] = arrays.forces[src]
        forces = forces.view(K, N, 3)

    flat_slot = pack * slots + slot  # flat over K * G
    y = empty((K * G,), torch.float32, 0)
    y[flat_slot] = arrays.y[molecules]
    molecule_index = empty((K * G,), torch.int64, -1)
    index = molecules if arrays.store_index is None else arrays.store_index[molecules]
    molecule_index[flat_slot] = index
    graph_mask = empty((K * G,), torch.bool, False)
    graph_mask[flat_slot] = True

    edge_index = edge_mask = None
    if lay.max_edges is not None:
        edge_index, edge_mask = _edges(arrays, layout, molecules, pack, atom_offset, padding, empty)
    return Assembled(
        z=z.view(K, N),
        pos=pos,
        graph=graph.view(K, N),
        node_mask=node_mask,
        y=y.view(K, G),
        graph_mask=graph_mask.view(K, G),
        molecule_index=molecule_index.view(K, G),
        edge_index=edge_index,
        edge_mask=edge_mask,
        forces=forces,
    )


def _edges(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack: Tensor,
    atom_offset: Tensor,
    padding: Tensor,
    empty,
) -> tuple[Tensor, Tensor]:
    """edge_index int64 [K, 2, E] and edge_mask bool [K, E] of the molecules' pairs.

    Each batch's forward pairs fill columns [0, its pairs) of the first half in molecule
    order, the reversed pairs the same columns of the second half; the rest join the batch's
    first padding atom (atom 0 when it has none) to itself.
    """
    B, size = layout.packs_per_batch, layout.max_nodes
    K, half = padding.shape[0], B * layout.max_edges // 2
    count = arrays.pair_count[molecules]
    pairs = _Items(count)  # in batch order, so each batch's pairs are one run
    source = pairs.ranges(arrays.pair_start[molecules])
    base = pairs.repeat(pack % B * size + atom_offset)
    first = base + arrays.pair_i[source]
    second = base + arrays.pair_j[source]
    batch_pairs = torch.zeros(K, dtype=torch.int64, device=count.device)
    batch_pairs.index_add_(0, pack // B, count)
    real = torch.arange(half, device=count.device) < batch_pairs.unsqueeze(1)  # [K, half]
    filler = padding.to(torch.uint8).argmax(1)  # first padding atom, 0 when there is none
    edge_index = empty((K, 2, 2, half), torch.int64)  # [batch, row, direction, column]
    edge_index.copy_(filler.view(K, 1, 1, 1).expand(K, 2, 2, half))
    edge_index[:, 0, 0].masked_scatter_(real, first)
    edge_index[:, 1, 0].masked_scatter_(real, second)
    edge_index[:, 0, 1].masked_scatter_(real, second)
    edge_index[:, 1, 1].masked_scatter_(real, first)
    edge_mask = empty((K, 2, half), torch.bool).copy_(real.unsqueeze(1).expand(K, 2, half))
    return edge_index.view(K, 2, 2 * half), edge_mask.view(K, 2 * half)


def _check_fits(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack: Tensor,
    slot: Tensor,
    n: Tensor,
    atom_end: Tensor,
    num_packs: int,
) -> None:
    """LoaderError for a molecule too large for any pack, or a pack over its limits."""
    lay = layout
    checks = [(n, atom_end, lay.max_nodes, "atoms", "max_nodes")]
    if lay.max_edges is not None:
        edges = 2 * arrays.pair_count[molecules]
        per_pack = torch.zeros(num_packs, dtype=torch.int64, device=n.device)
        per_pack.index_add_(0, pack, edges)
        checks.append((edges, per_pack[pack], lay.max_edges, "edges", "max_edges"))
    for own, in_pack, limit, what, key in checks:
        too_big = torch.nonzero(own > limit)
        if len(too_big):
            m = int(molecules[too_big[0, 0]])
            raise LoaderError(
                f"{arrays.name(m)} has {int(own[too_big[0, 0]])} {what}, more than a pack "
                f"holds ({key}={limit}); raise packing.{key} or drop the molecule"
            )
        over = torch.nonzero(in_pack > limit)
        if len(over):
            t = int(over[0, 0])
            raise LoaderError(
                f"pack {int(pack[t]) % lay.packs_per_batch} holds {int(in_pack[t])} {what} > "
                f"{limit} ({key}), reached at {arrays.name(int(molecules[t]))}"
            )
    over = torch.nonzero(slot >= lay.max_graphs)
    if len(over):
        t = int(over[0, 0])
        raise LoaderError(
            f"pack {int(pack[t]) % lay.packs_per_batch} holds more than {lay.max_graphs} "
            "molecules (max_graphs)"
        )
