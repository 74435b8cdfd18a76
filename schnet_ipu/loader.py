"""Packs -> fixed-shape batches, assembled many at a time by array programs.

One epoch is a list of packs (from :class:`schnet_ipu.packing.PackSlots`, re-drawn
per epoch), cut into micro-batches of B packs. A host call takes ``device_iterations x
gradient_accumulation`` micro-batches per replica, and replica r of R reads its own
share: global micro-batch ``(call * R + r) * calls_micro + j``. The epoch is padded at
its tail with empty packs so every replica gets the same number of host calls; those
packs are all padding and contribute nothing.

Batches are built a chunk (hundreds of batches) at a time by :func:`schnet_ipu.feed.assemble`
from the split's flat arrays (:class:`~schnet_ipu.feed.FeedArrays`), on the CPU (by a
compiled loop when numba is installed, :mod:`schnet_ipu.compiled_feed`) or, when the data
is device-resident, on the training device; a batch is a row of the chunk. With
``workers > 0`` background threads assemble the next chunks while the step runs (the
loop and the gathers release the GIL, and nothing is pickled). A batch depends only on the
seed, the epoch and its index, never on the mode, the chunking or the thread that built it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch
from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.graphs import molecule_pairs
from schnet_ipu.data.pairs import radius_pairs
from schnet_ipu.data.pairs_file import RadiusPairs
from schnet_ipu.data.periodic_pairs import PeriodicPairs, frame_pairs
from schnet_ipu.feed import (
    Assembled,
    FeedArrays,
    LoaderError,
    OutputBuffers,
    assemble,
    check_packs,
)
from schnet_ipu.packing import PackPlan, PackSlots
from schnet_ipu.packing.balance import DEFAULT_COST, loader_order

__all__ = [
    "Layout",
    "LoaderError",
    "PackMolecule",
    "PackedDataset",
    "PackedLoader",
    "collate",
]

CHUNK_BYTES = 24 << 20  # output bytes assembled at once (~120 QM9 batches: fits the L3 cache)


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


class PackedDataset:
    """This replica's micro-batches of every epoch, from one split's packs.

    Args:
        store: the molecule store.
        indices: int64 [M] store indices of the molecules of this split.
        targets: float64 [len(store)] regression target of every store molecule.
        plan: the packing plan for this split (from the node/edge counts of ``indices``).
        layout: batch shapes (and radius cutoff) and this replica's share.
        seed: the run seed; packs are re-drawn from (seed, epoch).
        edge_counts: int64 [M] directed edges per molecule of ``indices`` (radius graphs).
        shuffle: re-draw pack contents per epoch (False: the same packs every epoch).
        arrays: the store's feed arrays with ``targets`` (built from the store when None);
            batches are assembled on their device.

    ``compiled`` chooses how CPU batches are filled (see :func:`schnet_ipu.feed.assemble`;
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
    ) -> None:
        self.store = store
        self.indices = np.asarray(indices, dtype=np.int64)
        self.node_counts = store.num_atoms[self.indices]
        self.edge_counts = edge_counts
        self.plan = plan
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.arrays = arrays or FeedArrays.from_store(
            store, targets, None if layout.cutoff is None else radius_pairs(store, layout.cutoff)
        )
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
        micro = math.ceil(self.plan.num_packs / lay.packs_per_batch)
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
        ``buffers`` as :func:`~schnet_ipu.feed.assemble` takes them)."""
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
        """B packs of store indices (fewer at the epoch's tail) -> one fixed-shape Batch."""
        if len(packs) > self.layout.packs_per_batch:
            raise LoaderError(f"{len(packs)} packs for a batch of {self.layout.packs_per_batch}")
        device = self.arrays.device
        lengths = torch.zeros(self.layout.packs_per_batch, dtype=torch.int64)
        lengths[: len(packs)] = torch.tensor([len(p) for p in packs], dtype=torch.int64)
        molecules = torch.from_numpy(
            np.concatenate([np.zeros(0, np.int64), *packs]).astype(np.int64)
        )
        return unstack(
            assemble(self.arrays, self.layout, molecules.to(device), lengths.to(device))
        )[0]


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """Concatenated ``arange(s, s + l)`` for every (s, l) of ``starts``/``lengths`` [S]."""
    total = int(lengths.sum())
    segment = torch.repeat_interleave(
        torch.arange(len(lengths), device=lengths.device), lengths, output_size=total
    )
    offset = starts - (lengths.cumsum(0) - lengths)
    return torch.arange(total, device=lengths.device) + offset[segment]


def unstack(assembled: Assembled) -> list[Batch]:
    """Stacked batches -> one Batch per row (views, no copies), with the host molecule
    counts when known (so counting a device-resident batch never waits for the device)."""
    names = [name for name, value in vars(assembled).items() if isinstance(value, Tensor)]
    rows = zip(*(getattr(assembled, name).unbind(0) for name in names))
    batches = [Batch(**dict(zip(names, row))) for row in rows]
    for batch, count in zip(batches, assembled.num_molecules or []):
        batch.known_molecules = count
    return batches


class PackMolecule(NamedTuple):
    """One molecule as the collate needs it."""

    z: np.ndarray  # [n] atomic numbers
    pos: np.ndarray  # [n, 3] float32 positions in Angstrom
    y: float  # target
    index: int  # index in the store (-1 allowed for molecules from elsewhere)
    forces: np.ndarray | None = None  # [n, 3] float32 target forces, optional
    cell: np.ndarray | None = None  # [3, 3] lattice vectors as rows (periodic frames)
    pbc: np.ndarray | None = None  # bool [3] (with cell; None: periodic along all three)


def collate(
    packs: Sequence[Sequence[PackMolecule]], layout: Layout, with_forces: bool | None = None
) -> Batch:
    """Packs of molecules -> one Batch with the shapes of ``layout`` (see schnet_ipu.batch).

    For molecules outside a store (new structures, tests, benchmarks); the same array program
    as the loader builds it. Fewer packs than ``layout.packs_per_batch`` leave the rest empty
    (all padding). Raises LoaderError when a pack holds more atoms, molecules or edges than the
    layout allows. ``with_forces``: give the batch target forces (zeros on padding); None:
    when every molecule has them. Say so for a batch that may hold no molecule (an epoch's
    all-padding tail), so that it keeps the run's batch shape.
    """
    if len(packs) > layout.packs_per_batch:
        raise LoaderError(f"{len(packs)} packs for a batch of {layout.packs_per_batch}")
    molecules = [m for pack in packs for m in pack]
    sizes = np.array([len(m.z) for m in molecules], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    z = np.concatenate([np.zeros(0, np.uint8), *(np.asarray(m.z) for m in molecules)])
    pos = np.concatenate(
        [np.zeros((0, 3), np.float32), *(np.asarray(m.pos, np.float32) for m in molecules)]
    )
    if with_forces is None:
        with_forces = bool(molecules) and all(m.forces is not None for m in molecules)
    forces = None
    if with_forces:
        if any(m.forces is None for m in molecules):
            raise LoaderError("with_forces=True, but a molecule has no forces")
        forces = np.concatenate(
            [np.zeros((0, 3), np.float32), *(np.asarray(m.forces, np.float32) for m in molecules)]
        )
    pairs, cells = None, None
    if any(m.cell is not None for m in molecules):
        cells, pairs = _periodic_frames(molecules, layout.cutoff)
    elif layout.cutoff is not None:
        found = [molecule_pairs(m.pos, layout.cutoff) for m in molecules]
        counts = np.array([len(i) for i, _ in found], dtype=np.int64)
        i = torch.cat([torch.zeros(0, dtype=torch.int64), *(i for i, _ in found)]).numpy()
        j = torch.cat([torch.zeros(0, dtype=torch.int64), *(j for _, j in found)]).numpy()
        pairs = RadiusPairs(i, j, np.concatenate([[0], np.cumsum(counts)]), layout.cutoff)
    index = np.array([m.index for m in molecules], dtype=np.int64)
    arrays = FeedArrays.build(
        z, pos, forces, offsets, np.array([m.y for m in molecules], dtype=np.float64), pairs,
        ids=index, source="the given molecules", store_index=index, cell=cells,
    )  # fmt: skip
    lengths = torch.zeros(layout.packs_per_batch, dtype=torch.int64)
    lengths[: len(packs)] = torch.tensor([len(p) for p in packs], dtype=torch.int64)
    return unstack(assemble(arrays, layout, torch.arange(len(molecules)), lengths))[0]


def _periodic_frames(
    molecules: Sequence[PackMolecule], cutoff: float | None
) -> tuple[np.ndarray, PeriodicPairs]:
    """Cells float32 [M, 3, 3] (zeros for a molecule without one) and the periodic pairs of
    ``molecules`` (:func:`~schnet_ipu.data.periodic_pairs.frame_pairs`; radius graphs only)."""
    if cutoff is None:
        raise LoaderError("periodic frames need a radius graph (model.graph: radius)")
    cells = np.zeros((len(molecules), 3, 3))
    found = []
    for m, molecule in enumerate(molecules):
        pbc = np.zeros(3, bool)
        if molecule.cell is not None:
            cells[m] = molecule.cell
            pbc = np.ones(3, bool) if molecule.pbc is None else np.asarray(molecule.pbc, bool)
        found.append(frame_pairs(molecule.pos, cells[m], pbc, cutoff))
    counts = np.array([len(i) for i, _, _ in found], dtype=np.int64)
    pairs = PeriodicPairs(
        i=np.concatenate([np.zeros(0, np.int64), *(i for i, _, _ in found)]),
        j=np.concatenate([np.zeros(0, np.int64), *(j for _, j, _ in found)]),
        offsets=np.concatenate([[0], np.cumsum(counts)]),
        cutoff=cutoff,
        shift=np.concatenate([np.zeros((0, 3), np.int8), *(s for _, _, s in found)]),
    )
    return cells, pairs


class PackedLoader:
    """Iterates host calls (lists of ``micro_per_call`` Batches) over an epoch.

    ``workers = 0`` assembles chunks of batches only while the caller waits for them (never
    while a training step runs): on a CPU with several torch threads, one chunk per thread at
    once, each thread on its own chunk with one torch thread (the compiled loop runs on one
    core, and so do cumsum and the int32 gathers of the torch program whatever torch's thread
    count: this keeps every core busy). ``workers > 0`` background threads assemble up to
    ``max(prefetch, workers)`` chunks ahead, also while the step runs. ``pin_memory``: CPU
    chunks go to pinned memory (non-blocking copies to CUDA); otherwise to memory from
    ``buffers`` (its own when None), reused once no batch views it. Every batch is checked
    against the first batch's shapes.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        chunk_batches: int | None = None,
        buffers: OutputBuffers | None = None,
    ) -> None:
        self.dataset = dataset
        self.workers = workers
        self.ahead = max(prefetch, workers, 1)
        self.pin = pin_memory
        self.signature: tuple | None = None
        per_batch = dataset.arrays.batch_bytes(dataset.layout)
        self.chunk_batches = chunk_batches or max(1, CHUNK_BYTES // per_batch)
        on_cpu = dataset.arrays.device.type == "cpu"
        self.at_once = 1 if workers or not on_cpu else torch.get_num_threads()
        self.buffers = None  # pinned memory is reused by torch's allocator; CUDA memory too
        if on_cpu and not pin_memory:
            self.buffers = buffers if buffers is not None else OutputBuffers()
            # chunks alive at once: those being assembled or queued, and the one being read
            self.buffers.keep_at_least(self.ahead + self.at_once + 1)
        self._pool = None
        if workers:
            self._pool = ThreadPoolExecutor(workers, "feed")
        elif self.at_once > 1:
            self._pool = ThreadPoolExecutor(self.at_once, "feed", torch.set_num_threads, (1,))

    def __len__(self) -> int:
        """Host calls per epoch."""
        return self.dataset.calls_per_epoch

    def epoch(self, epoch: int, start_call: int = 0) -> Iterator[list[Batch]]:
        """Host calls of an epoch, from ``start_call`` on (a resumed epoch skips the rest)."""
        micro = self.dataset.layout.micro_per_call
        call: list[Batch] = []
        for chunk in self._chunks(epoch, start_call * micro):
            self.check_shape(chunk[0])  # the rows of a chunk share its shapes
            for batch in chunk:
                call.append(batch)
                if len(call) == micro:
                    yield call
                    call = []

    def _chunks(self, epoch: int, first: int) -> Iterator[list[Batch]]:
        """The epoch's batches from micro-batch ``first`` on, a chunk (list) at a time."""
        total = len(self.dataset)
        bounds = [
            (a, min(a + self.chunk_batches, total)) for a in range(first, total, self.chunk_batches)
        ]
        if self._pool is None:
            for a, b in bounds:
                yield unstack(self._assemble(epoch, a, b))
            return
        self.dataset.batch_order(epoch)  # worked out once here, not raced for by the threads
        if not self.workers:  # at_once chunks in parallel, all done before the caller goes on
            for i in range(0, len(bounds), self.at_once):
                futures = [
                    self._pool.submit(self._assemble, epoch, a, b)
                    for a, b in bounds[i : i + self.at_once]
                ]
                group = [unstack(future.result()) for future in futures]  # (then yield)
                del futures  # a finished future holds its chunk: the memory would stay busy
                while group:  # nor does this generator hold a chunk it has handed out
                    yield group.pop(0)
            return
        chunks = iter(bounds)
        pending: deque = deque()

        def submit() -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append(self._pool.submit(self._assemble, epoch, *chunk))

        for _ in range(self.ahead):
            submit()
        while pending:
            assembled = pending.popleft().result()
            submit()
            yield unstack(assembled)

    def _assemble(self, epoch: int, first: int, stop: int) -> Assembled:
        return self.dataset.assemble(epoch, first, stop, self.pin, self.buffers)

    def check_shape(self, batch: Batch) -> None:
        signature = batch.signature()
        if self.signature is None:
            self.signature = signature
        elif signature != self.signature:
            raise LoaderError(
                f"batch shapes changed mid-run: {signature} != {self.signature}; "
                "fixed-shape batches are a contract of the loader"
            )
