"""The epoch schedule: which molecules make which micro-batch of this replica, per epoch.

One epoch is a list of packs (from :class:`schnet_ipu.packing.PackSlots`, re-drawn
per epoch), cut into micro-batches of B packs. A host call takes ``device_iterations x
gradient_accumulation`` micro-batches per replica, and replica r of R reads its own
share: global micro-batch ``(call * R + r) * calls_micro + j``. The epoch is padded at
its tail with empty packs so every replica gets the same number of host calls; those
packs are all padding and contribute nothing. With ``replica_balance: cost_model`` the
micro-batches replicas run in one step are grouped by predicted cost.

:class:`PackedDataset` works the order out once per epoch (flat, on the feed arrays'
device, checked against the layout's limits at once) and assembles any range of it
(:func:`schnet_ipu.feed.assembly.assemble`). A batch depends only on the seed, the epoch and its
index, never on the chunking or the thread that built it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.pairs import radius_pairs
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.assembly import assemble, assemble_batch
from schnet_ipu.feed.chunk import Assembled, OutputBuffers, unstack
from schnet_ipu.feed.layout import Layout
from schnet_ipu.feed.limits import check_packs
from schnet_ipu.packing import PackPlan, PackSlots
from schnet_ipu.packing.balance import DEFAULT_COST, loader_order


class PackedDataset:
    """This replica's micro-batches of every epoch, from one split's packs.

    Args:
        store: the molecule store.
        indices: int64 [M] the molecules of this split as rows of ``arrays``: store indices
            when the arrays hold the whole store.
        targets: float64 [len(store)] regression target of every store molecule.
        plan: the packing plan for this split (from the node/edge counts of ``indices``).
        layout: batch shapes (and radius cutoff) and this replica's share.
        seed: the run seed; packs are re-drawn from (seed, epoch).
        edge_counts: int64 [M] directed edges per molecule of ``indices`` (radius graphs).
        shuffle: re-draw pack contents per epoch (False: the same packs every epoch).
        arrays: the store's feed arrays with ``targets`` (built from the store when None);
            batches are assembled on their device.
        epoch_packs: packs every epoch is padded to with empty ones (a replica's shard of the
            split: the largest shard's, :mod:`schnet_ipu.packing.shards`); None: the plan's.

    ``compiled`` chooses how CPU batches are filled (see :func:`schnet_ipu.feed.assembly.assemble`;
    None: numba's loop when installed); the bytes are the same either way.
    """

    def __init__(
        self,
        store: MoleculeStore,
        indices: np.ndarray,
        targets: np.ndarray,
        plan: PackPlan,
        layout: Layout,
        seed: int,
        edge_counts: np.ndarray | None = None,
        shuffle: bool = True,
        arrays: FeedArrays | None = None,
        epoch_packs: int | None = None,
    ) -> None:
        self.store = store
        self.indices = np.asarray(indices, dtype=np.int64)
        self.edge_counts = edge_counts
        self.plan = plan
        self.epoch_packs = plan.num_packs if epoch_packs is None else epoch_packs
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.arrays = arrays or FeedArrays.from_store(
            store, targets, None if layout.cutoff is None else radius_pairs(store, layout.cutoff)
        )
        self.node_counts = self.arrays.num_atoms.cpu().numpy()[self.indices]
        self.slots = PackSlots(plan, self.node_counts, edge_counts)
        self.compiled: bool | None = None
        self._packs_epoch: int | None = None
        self._packs: tuple[Tensor, Tensor, Tensor] | None = None
        self._order_epoch: int | None = None
        self._order: tuple[Tensor, Tensor, list[int]] | None = None

    # --- sizes -----------------------------------------------------------------------------

    @property
    def calls_per_epoch(self) -> int:
        """Host calls per replica per epoch (equal on every replica)."""
        lay = self.layout
        micro = math.ceil(self.epoch_packs / lay.packs_per_batch)
        return math.ceil(micro / (lay.micro_per_call * lay.replicas))

    def __len__(self) -> int:
        """Micro-batches this replica reads per epoch."""
        return self.calls_per_epoch * self.layout.micro_per_call

    # --- items -----------------------------------------------------------------------------

    def packs(self, epoch: int) -> tuple[Tensor, Tensor, Tensor]:
        """The epoch's packs, flat on the arrays' device (cached per epoch): store indices
        int64 [M] in pack order, and each pack's first position and length, int64 [P]."""
        if self._packs_epoch != epoch:
            draw = epoch if self.shuffle else 0
            local, lengths = self.slots.draw(self.seed, draw)
            starts = np.cumsum(lengths) - lengths
            if self.layout.replica_balance == "cost_model" and self.layout.replicas > 1:
                starts, lengths = self._group_by_cost(local, starts, lengths, epoch)
            device = self.arrays.device
            self._packs = (
                torch.from_numpy(self.indices[local]).to(device),
                torch.from_numpy(starts).to(device),
                torch.from_numpy(lengths).to(device),
            )
            self._packs_epoch = epoch
        return self._packs

    def _group_by_cost(
        self, local: np.ndarray, starts: np.ndarray, lengths: np.ndarray, epoch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The packs (``starts``/``lengths`` [P] into ``local``) reordered so that the
        micro-batches replicas run in one step have like predicted cost
        (:func:`~schnet_ipu.packing.balance.loader_order`, the default cost model on real
        atoms and edges); empty packs (length 0) fill idle slots. -> (starts, lengths) [P']."""
        size, lay = self.layout.packs_per_batch, self.layout
        packs = len(lengths)
        micro = np.repeat(np.arange(packs), lengths) // size  # micro-batch of each molecule
        count = -(-packs // size)
        atoms = np.bincount(micro, weights=self.node_counts[local], minlength=count)
        edges = np.zeros(count)
        if self.edge_counts is not None:
            edges = np.bincount(micro, weights=self.edge_counts[local], minlength=count)
        order = loader_order(
            DEFAULT_COST.predict(atoms, edges), lay.replicas, lay.micro_per_call, self.seed + epoch
        )
        pack = (order[:, None] * size + np.arange(size)).reshape(-1)
        real = (np.repeat(order, size) >= 0) & (pack < packs)
        pack = np.where(real, pack, 0)
        return np.where(real, starts[pack], 0), np.where(real, lengths[pack], 0)

    def global_micro_batch(self, i: int) -> int:
        lay = self.layout
        call, j = divmod(i, lay.micro_per_call)
        return (call * lay.replicas + lay.replica) * lay.micro_per_call + j

    def batch_order(self, epoch: int) -> tuple[Tensor, Tensor, list[int]]:
        """This replica's micro-batches of ``epoch`` flat, on the arrays' device (cached per
        epoch): store indices int64 [T] batch after batch, pack lengths int64 [len(self) * B]
        (0 for the empty packs past the epoch's end), and where each micro-batch's molecules
        start, [len(self) + 1]."""
        if self._order_epoch != epoch:
            lay = self.layout
            molecules, starts, lengths = self.packs(epoch)
            device = molecules.device
            i = torch.arange(len(self), device=device)
            call, j = i // lay.micro_per_call, i % lay.micro_per_call
            micro = (call * lay.replicas + lay.replica) * lay.micro_per_call + j
            pack = (
                micro.unsqueeze(1) * lay.packs_per_batch
                + torch.arange(lay.packs_per_batch, device=device)
            ).view(-1)
            real = pack < len(lengths)  # packs past the epoch's end stay empty
            pack = pack.clamp(max=len(lengths) - 1)
            pack_lengths = torch.where(real, lengths[pack], 0)
            per_batch = pack_lengths.view(-1, lay.packs_per_batch).sum(1)
            first = [0, *per_batch.cumsum(0).tolist()]
            ordered = molecules[_ranges(starts[pack], pack_lengths)]
            check_packs(self.arrays, lay, ordered, pack_lengths)  # the whole epoch at once
            self._order = (ordered, pack_lengths, first)
            self._order_epoch = epoch
        return self._order

    def assemble(
        self,
        epoch: int,
        first: int,
        stop: int,
        pin: bool = False,
        buffers: OutputBuffers | None = None,
    ) -> Assembled:
        """This replica's micro-batches [first, stop) of ``epoch``, stacked (``pin`` and
        ``buffers`` as :func:`~schnet_ipu.feed.assembly.assemble` takes them)."""
        molecules, pack_lengths, start = self.batch_order(epoch)
        B = self.layout.packs_per_batch
        assembled = assemble(
            self.arrays,
            self.layout,
            molecules[start[first] : start[stop]],
            pack_lengths[first * B : stop * B],
            pin,
            checked=True,  # by batch_order
            buffers=buffers,
            compiled=self.compiled,
        )
        assembled.num_molecules = [b - a for a, b in zip(start[first:stop], start[first + 1 :])]
        return assembled

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, i = key
        return unstack(self.assemble(epoch, i, i + 1))[0]

    def collate(self, packs: list[np.ndarray]) -> Batch:
        """B packs of store indices (fewer at the epoch's tail) -> one fixed-shape Batch
        (:func:`~schnet_ipu.feed.assembly.assemble_batch` on this split's arrays)."""
        return assemble_batch(self.arrays, self.layout, packs)


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenated ``arange(s, s + l)`` for every (s, l) of ``starts``/``lengths`` [S]."""
    total = int(lengths.sum())
    segment = torch.repeat_interleave(
        torch.arange(len(lengths), device=lengths.device), lengths, output_size=total
    )
    offset = starts - (lengths.cumsum(0) - lengths)
    return torch.arange(total, device=lengths.device) + offset[segment]
