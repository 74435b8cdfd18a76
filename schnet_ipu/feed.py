"""Batches as array programs: many fixed-shape batches from a few gathers over flat arrays.

:class:`FeedArrays` holds a split's source data flat, as torch tensors on one device (CPU,
or the training device when the data is device-resident): the store's concatenated atoms,
per-molecule offsets, targets and, for radius graphs, the pairs file's pairs.
:func:`assemble` turns K batches worth of packs, given flat (molecules in pack order, pack
lengths), into [K, ...] tensors with no Python loop over molecules or packs; the loader
hands out their rows as :class:`~schnet_ipu.batch.Batch` views.

Radius edges keep the order of a per-pack search: pack, then i, then j (i < j), forward
pairs first, then the same pairs reversed (see schnet_ipu.batch). Periodic stores (with
cells) add each pair's integer cell shift S (the reversed pair gets -S) and each molecule
slot's cell. Stores with partial labels add each slot's ``forces_mask`` / ``stress_mask``
(False on padding slots).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from schnet_ipu import compiled_feed
from schnet_ipu.data import MoleculeStore
from schnet_ipu.data.pairs_file import RadiusPairs
from schnet_ipu.data.periodic_pairs import PeriodicPairs
from schnet_ipu.errors import UserError

if TYPE_CHECKING:
    from schnet_ipu.loader import Layout

PADDING_SPACING = 100.0  # Angstrom between padding atoms; far beyond any cutoff
PADDING_ORIGIN = 1000.0  # Angstrom; padding atoms sit on a line starting here


class LoaderError(UserError, RuntimeError):
    """A batch could not be built or changed shape mid-run."""


@dataclass
class FeedArrays:
    """Flat source arrays of M molecules and A atoms (P radius pairs), all on ``device``;
    every per-atom and per-pair array ends in one padding entry."""

    z: Tensor  # uint8 [A + 1] atomic numbers; entry A is the padding atom (0)
    pos: Tensor  # float32 [A + 1, 3]
    forces: Tensor | None  # float32 [A + 1, 3], stores with forces only
    atom_start: Tensor  # int64 [M] first atom of each molecule
    num_atoms: Tensor  # int64 [M]
    y: Tensor  # float32 [M] targets
    pair_ij: Tensor | None  # int16 (or int32) [P + 1, 2] local (i, j), i < j, radius graphs
    # only; entry P is the padding pair (0, 0)
    pair_start: Tensor | None  # int64 [M] first pair of each molecule
    pair_count: Tensor | None  # int64 [M]
    ids: np.ndarray  # int64 [M] record ids, for error messages
    source: str  # where the molecules come from, for error messages
    store_index: Tensor | None = None  # int64 [M] molecule_index of each; None: 0..M-1
    cell: Tensor | None = None  # float32 [M, 3, 3] lattice vectors (rows); periodic stores only
    pair_shift: Tensor | None = None  # int8 [P + 1, 3] cell shift S of each pair (last: 0);
    # periodic stores' radius graphs only
    stress: Tensor | None = None  # float32 [M, 3, 3] target stress; stores with stress only
    forces_mask: Tensor | None = None  # bool [M] frame carries forces; partial forces only
    stress_mask: Tensor | None = None  # bool [M] frame carries stress; partial stress only

    @classmethod
    def from_store(
        cls,
        store: MoleculeStore,
        targets: np.ndarray,
        pairs: RadiusPairs | None,
        device="cpu",
        atoms: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> FeedArrays:
        """The whole store (``targets`` [M]), on ``device``; ``pairs``: the store's radius
        pairs (:func:`~schnet_ipu.data.pairs.radius_pairs`) for radius graphs, else None;
        ``atoms``: the store's (z, pos) when the caller has read them already."""
        try:
            z, pos = store.concatenated() if atoms is None else atoms
            forces = store.forces() if store.has_forces else None
            cell = store.cells()[0] if store.periodic else None
            stress = store.stress() if store.has_stress else None
            partial = store.partial_labels
            forces_mask = store.forces_mask() if "forces" in partial else None
            stress_mask = store.stress_mask() if "stress" in partial else None
        except OSError as err:
            raise LoaderError(f"cannot read the molecules of {store.path}: {err}") from err
        source = str(store.path)
        arrays = cls.build(
            z,
            pos,
            forces,
            store.offsets,
            targets,
            pairs,
            store.ids,
            source,
            cell=cell,
            stress=stress,
            forces_mask=forces_mask,
            stress_mask=stress_mask,
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
        cell: np.ndarray | None = None,
        stress: np.ndarray | None = None,
        forces_mask: np.ndarray | None = None,
        stress_mask: np.ndarray | None = None,
    ) -> FeedArrays:
        """CPU feed arrays from numpy: ``offsets`` int [M + 1] splits z [A] / pos [A, 3];
        ``cell`` [M, 3, 3] for periodic stores (whose ``pairs`` are PeriodicPairs), and
        their target ``stress`` [M, 3, 3] when the store has it; ``forces_mask`` /
        ``stress_mask`` bool [M] when only some frames carry forces / stress.

        Each per-atom and per-pair array gets one zero entry at its end: padding atoms and
        padding edges of a batch are gathered from it (z 0, position 0, local atoms 0, no
        shift).
        """
        if cell is None and isinstance(pairs, PeriodicPairs):
            raise LoaderError(f"{source}: periodic pairs need the frames' cells")
        offsets = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        pair_offsets = None if pairs is None else torch.from_numpy(pairs.offsets)
        return cls(
            z=_with_zero_entry(np.asarray(z, dtype=np.uint8)),
            pos=_with_zero_entry(np.asarray(pos, dtype=np.float32)),
            forces=None if forces is None else _with_zero_entry(forces),
            atom_start=offsets[:-1],
            num_atoms=offsets.diff(),
            y=torch.from_numpy(np.asarray(targets)).to(torch.float32),
            pair_ij=None if pairs is None else _pair_table(pairs),
            pair_start=None if pairs is None else pair_offsets[:-1],
            pair_count=None if pairs is None else pair_offsets.diff(),
            ids=np.asarray(ids, dtype=np.int64),
            source=source,
            store_index=None if store_index is None else torch.as_tensor(store_index),
            cell=None if cell is None else torch.from_numpy(np.asarray(cell, np.float32)),
            stress=None if stress is None else torch.from_numpy(np.asarray(stress, np.float32)),
            forces_mask=None if forces_mask is None else torch.from_numpy(_bools(forces_mask)),
            stress_mask=None if stress_mask is None else torch.from_numpy(_bools(stress_mask)),
            pair_shift=(
                _with_zero_entry(pairs.shift) if isinstance(pairs, PeriodicPairs) else None
            ),
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

    @property
    def label_masks(self) -> int:
        """How many per-frame label masks the batches carry (0, 1 or 2)."""
        return (self.forces_mask is not None) + (self.stress_mask is not None)

    def batch_bytes(self, layout: Layout) -> int:
        """Bytes of one batch assembled from these arrays."""
        return layout.batch_bytes(
            self.forces is not None,
            self.cell is not None,
            self.stress is not None,
            self.label_masks,
        )


def _bools(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.bool_)


def _pair_table(pairs: RadiusPairs) -> Tensor:
    """[P + 1, 2] local (i, j) as int16 (int32 for molecules of 2**15 atoms or more, the dtype
    of a batch's atom rows: a gathered pair needs no conversion), ending in the padding
    pair (0, 0). Allocated by torch (why: :class:`OutputBuffers`), filled by numpy (its
    strided copies are ~3x torch's here)."""
    dtype = torch.int16 if int(pairs.j.max(initial=0)) < 2**15 else torch.int32
    table = torch.empty((len(pairs.i) + 1, 2), dtype=dtype)
    rows = table.numpy()
    rows[:-1, 0], rows[:-1, 1], rows[-1] = pairs.i, pairs.j, 0
    return table


def _with_zero_entry(values: np.ndarray) -> Tensor:
    """values [L, ...] -> tensor [L + 1, ...] ending in zeros (one copy)."""
    source = torch.from_numpy(np.ascontiguousarray(values))
    out = source.new_zeros((len(values) + 1, *values.shape[1:]))
    out[:-1] = source
    return out


class OutputBuffers:
    """CPU memory for assembled chunks, used again once the batches viewing it are gone.

    Each chunk's tensors are views of one byte buffer from here. A chunk is tens of MB: glibc
    serves such blocks from fresh kernel pages and often hands them back when they are freed,
    so without reuse a warm epoch took 20-60k page faults, and epochs with them ran 20-40%
    slower on the 2-core dev box. A buffer is handed out again only when no tensor viewing it
    is alive: the tensors' storage holds the only reference to a numpy view of the buffer,
    watched here by a weak reference, so batches a caller keeps are never overwritten.
    At most ``keep`` buffers are kept; past that, chunks get memory of their own. Loaders
    that take turns share one (a run's train, val and test loaders).

    Buffers are allocated by torch, not numpy: numpy asks the kernel for transparent huge
    pages, and once a process had allocated and freed a few hundred MB, filling a fresh
    80 MB numpy array stalled 0.15-0.23 s on the dev box (memory compaction), against a
    steady 0.06-0.07 s for torch's memory.
    """

    def __init__(self, keep: int = 0) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []  # uint8, kept for the whole run
        self._views: list[weakref.ref | None] = []  # the live view of each buffer, if any
        self._lock = threading.Lock()  # chunks are assembled on several threads

    def take(self, nbytes: int) -> Tensor:
        """uint8 [nbytes] that no live tensor views."""
        with self._lock:
            for k, buffer in enumerate(self._buffers):
                view = self._views[k]
                if len(buffer) >= nbytes and (view is None or view() is None):
                    return self._hand_out(k, nbytes)
            if len(self._buffers) < self.keep:
                self._buffers.append(torch.empty(nbytes, dtype=torch.uint8).numpy())
                self._views.append(None)
                return self._hand_out(len(self._buffers) - 1, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def keep_at_least(self, count: int) -> None:
        """Keep up to ``count`` buffers (a loader's chunks alive at once)."""
        self.keep = max(self.keep, count)

    def _hand_out(self, k: int, nbytes: int) -> Tensor:
        view = self._buffers[k][:nbytes]  # a new array object: only the tensor will hold it
        self._views[k] = weakref.ref(view)
        return torch.from_numpy(view)

    def nbytes(self) -> int:
        return sum(len(buffer) for buffer in self._buffers)


class _Outputs:
    """Output tensors of one chunk, laid end to end in one buffer (``buffers``), or each on
    its own (pinned for non-blocking copies to CUDA when ``pin``) without one."""

    ALIGN = 64  # bytes; every tensor starts on a cache line

    def __init__(
        self, nbytes: int, device: torch.device, pin: bool, buffers: OutputBuffers | None
    ) -> None:
        self.device, self.pin = device, pin and device.type == "cpu"
        use_buffers = buffers is not None and device.type == "cpu" and not self.pin
        slack = 16 * self.ALIGN  # room to align each of the (at most 15) tensors
        self.memory = buffers.take(nbytes + slack) if use_buffers else None
        self.used = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self.memory is None:
            return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin)
        size = math.prod(shape) * _itemsize(dtype)
        start = self.used
        self.used = -(-(start + size) // self.ALIGN) * self.ALIGN
        return self.memory[start : start + size].view(dtype).view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()  # (torch 2.0 has no dtype.itemsize)


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
    edge_shift: Tensor | None = None  # int32 [K, E, 3] (periodic radius graphs)
    cell: Tensor | None = None  # float32 [K, G, 3, 3] (periodic stores)
    stress: Tensor | None = None  # float32 [K, G, 3, 3] (stores with stress)
    forces_mask: Tensor | None = None  # bool [K, G] (stores with partial forces)
    stress_mask: Tensor | None = None  # bool [K, G] (stores with partial stress)
    num_molecules: list[int] | None = None  # [K] real molecules per batch, when known on the host


def _exclusive_cumsum(counts: Tensor) -> Tensor:
    return counts.cumsum(0) - counts


_TWICE_AS_WIDE = {torch.int16: torch.int32, torch.int32: torch.int64}


def _node_dtype(atoms: int) -> torch.dtype:
    """The narrowest dtype for atom rows of a batch of ``atoms`` atoms."""
    return torch.int16 if atoms < 2**15 else torch.int32


def _index_dtype(size: int) -> torch.dtype:
    """The narrowest index dtype for ``size`` entries (int32 halves the index traffic)."""
    return torch.int32 if size < 2**31 else torch.int64


class _PaddedRuns:
    """Runs of items laid end to end, group after group, each group filled to ``width``.

    Items t = 0..T-1 (sorted by ``group`` [T]) own ``lengths[t]`` positions each; after the
    last item of group g one padding run fills the group to ``width``. So the output has
    ``groups * width`` positions, group g owning [g * width, (g + 1) * width): the rows of
    the packs (atoms) or of the batches (pairs) exactly as they appear in the batch tensors.
    A per-position value is a per-run value plus a slope times the rank inside the run; it
    is built as the running sum of its steps, which change only where a run starts (one
    fill, one small scatter and one cumsum over the positions; no scatter or mask per item).
    """

    def __init__(
        self, group: Tensor, lengths: Tensor, items: Tensor, used: Tensor, width: int
    ) -> None:
        """``items`` [groups]: items in each group; ``used`` [groups]: positions they take (at
        most ``width``). Nothing here waits for a GPU (no host reads)."""
        dev, count, groups = group.device, len(group), len(used)
        self.groups, self.total = groups, groups * width
        through = items.cumsum(0)  # items in groups <= g
        self.item_at = torch.arange(count, device=dev) + group  # place among the runs
        self.pad_at = through + torch.arange(groups, device=dev)
        self.first = _exclusive_cumsum(self.interleave(lengths, width - used))  # [runs]

    def interleave(self, items: Tensor, padding: Tensor | int) -> Tensor:
        """Per-run values: ``items`` [T] for the item runs, ``padding`` (scalar or [groups])."""
        out = items.new_empty(len(items) + self.groups)
        out[self.item_at] = items
        out[self.pad_at] = padding
        return out

    def _positions(
        self, values: Tensor, slope: int, dtype: torch.dtype, out: Tensor | None = None
    ) -> Tensor:
        """[total]: ``values[run] + slope * rank`` at each position (``values`` per run)."""
        offset = (values - slope * self.first).to(dtype)  # each run's line, at position 0
        step = offset.new_full((self.total + 1,), slope)  # + 1: trailing empty runs land there
        change = offset.diff(prepend=offset.new_full((1,), slope))
        step.index_add_(0, self.first, change)
        return torch.cumsum(step[:-1], 0, dtype=dtype, out=out)

    def repeat(
        self,
        items: Tensor,
        padding: Tensor | int,
        dtype: torch.dtype | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """[total]: each run's value (``items`` [T] / ``padding``) at each of its positions,
        in ``dtype`` or into ``out``."""
        values = self.interleave(items, padding)
        return self._positions(values, 0, out.dtype if out is not None else dtype, out)

    def ranges(self, starts: Tensor, pad: int) -> Tensor:
        """[total] source indices: ``starts[t] + rank`` in item t's run; every padding
        position reads entry ``pad``, which must be the last entry of the source."""
        dtype = _index_dtype(pad + 1)
        return self._positions(self.interleave(starts, pad), 1, dtype).clamp_(max=pad)


class _PackTotals(NamedTuple):
    """Per molecule T and per pack P of packs given flat (molecules in pack order)."""

    pack: Tensor  # int64 [T] flat pack of each molecule
    atoms: Tensor  # int64 [T] atoms of each molecule
    pairs: Tensor | None  # int64 [T] radius pairs of each molecule (radius graphs only)
    pack_atoms: Tensor  # int64 [P]
    pack_pairs: Tensor | None  # int64 [P] (radius graphs only)


def _pack_totals(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor
) -> _PackTotals:
    P, dev = len(pack_lengths), arrays.device
    pack = torch.repeat_interleave(
        torch.arange(P, device=dev), pack_lengths, output_size=len(molecules)
    )
    atoms = arrays.num_atoms.index_select(0, molecules)
    pack_atoms = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, pack, atoms)
    pairs = pack_pairs = None
    if layout.max_edges is not None:
        pairs = arrays.pair_count.index_select(0, molecules)
        pack_pairs = torch.zeros(P, dtype=torch.int64, device=dev).index_add_(0, pack, pairs)
    return _PackTotals(pack, atoms, pairs, pack_atoms, pack_pairs)


def check_packs(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor
) -> None:
    """LoaderError naming the molecule (index and record id) when one molecule exceeds the
    pack's atom or edge limit, or the pack when its molecules together do (packs given as
    to :func:`assemble`). One host read of the device: the loader checks a whole epoch at
    once, so that on a GPU no chunk waits for the steps queued before it."""
    totals = _pack_totals(arrays, layout, molecules, pack_lengths)
    _check_fits(arrays, layout, molecules, pack_lengths, totals.pack_atoms, totals.pack_pairs)


def assemble(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack_lengths: Tensor,
    pin: bool = False,
    checked: bool = False,
    buffers: OutputBuffers | None = None,
    compiled: bool | None = None,
) -> Assembled:
    """K batches from packs given flat: ``molecules`` int64 [T] indices into ``arrays`` in
    pack order, ``pack_lengths`` int64 [K * B] molecules per pack (0 = an empty pack).

    Raises LoaderError as :func:`check_packs` does, unless ``checked`` (the caller checked
    these packs). ``pin``: allocate the CPU outputs in pinned memory (for non-blocking copies
    to CUDA); else ``buffers``: CPU outputs go to memory from there. ``compiled``: fill CPU
    batches by :mod:`schnet_ipu.compiled_feed`'s loop (None: when numba is installed) rather
    than by the torch program below; both give the same bytes.
    """
    K = len(pack_lengths) // layout.packs_per_batch
    nbytes = K * arrays.batch_bytes(layout)
    output = _Outputs(nbytes, arrays.device, pin, buffers)
    if compiled is None:
        compiled = compiled_feed.AVAILABLE
    if compiled and arrays.device.type == "cpu":
        return _fill_compiled(arrays, layout, molecules, pack_lengths, output)
    lay, dev = layout, arrays.device
    B, size, slots = lay.packs_per_batch, lay.max_nodes, lay.max_graphs
    N, G = B * size, B * slots
    count = len(molecules)
    pack, n, pairs, pack_atoms, pack_pairs = _pack_totals(arrays, layout, molecules, pack_lengths)
    if not checked:
        _check_fits(arrays, layout, molecules, pack_lengths, pack_atoms, pack_pairs)
    pack_first = _exclusive_cumsum(pack_lengths)[pack]  # [T] first molecule of each one's pack
    slot = torch.arange(count, device=dev) - pack_first
    first_atom = _exclusive_cumsum(n)
    atom_offset = first_atom - first_atom[pack_first]

    rows = _PaddedRuns(pack, n, pack_lengths, pack_atoms, size)  # the K * N atom rows
    source = rows.ranges(arrays.atom_start[molecules], len(arrays.z) - 1)
    z = output((K * N,), torch.int64).copy_(arrays.z.index_select(0, source))
    pos = torch.index_select(arrays.pos, 0, source, out=output((K * N, 3), torch.float32))
    graph = output((K * N,), torch.int64)  # each atom's slot; G: padding
    rows.repeat(pack % B * slots + slot, G, out=graph)
    node_mask = torch.lt(graph, G, out=output((K * N,), torch.bool)).view(K, N)
    padding = ~node_mask
    padding_x = PADDING_ORIGIN + PADDING_SPACING * (padding.cumsum(1) - 1)
    pos = pos.view(K, N, 3)
    pos[..., 0] = torch.where(node_mask, pos[..., 0], padding_x)
    forces = None
    if arrays.forces is not None:
        forces = torch.index_select(
            arrays.forces, 0, source, out=output((K * N, 3), torch.float32)
        ).view(K, N, 3)

    flat_slot = pack * slots + slot  # flat over K * G
    y = output((K * G,), torch.float32).fill_(0)
    y[flat_slot] = arrays.y[molecules]
    molecule_index = output((K * G,), torch.int64).fill_(-1)
    index = molecules if arrays.store_index is None else arrays.store_index[molecules]
    molecule_index[flat_slot] = index
    graph_mask = output((K * G,), torch.bool).fill_(False)
    graph_mask[flat_slot] = True
    cell = None
    if arrays.cell is not None:
        cell = output((K * G, 3, 3), torch.float32).fill_(0)
        cell[flat_slot] = arrays.cell[molecules]
        cell = cell.view(K, G, 3, 3)
    stress = None
    if arrays.stress is not None:
        stress = output((K * G, 3, 3), torch.float32).fill_(0)
        stress[flat_slot] = arrays.stress[molecules]
        stress = stress.view(K, G, 3, 3)
    masks = {}
    for name in ("forces_mask", "stress_mask"):
        carried = getattr(arrays, name)
        if carried is not None:
            mask = output((K * G,), torch.bool).fill_(False)
            mask[flat_slot] = carried[molecules]
            masks[name] = mask.view(K, G)

    edge_index = edge_mask = edge_shift = None
    if lay.max_edges is not None:
        edge_index, edge_mask, edge_shift = _edges(
            arrays,
            layout,
            molecules,
            pack,
            pack_lengths,
            pairs,
            pack_pairs,
            atom_offset,
            padding,
            output,
        )
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
        edge_shift=edge_shift,
        cell=cell,
        stress=stress,
        **masks,
    )


def _fill_compiled(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor, output: _Outputs
) -> Assembled:
    """:func:`assemble` by the compiled loop: CPU ``arrays``, packs as assemble takes them.
    The loop checks every pack as :func:`check_packs` does (a pack it cannot hold is then
    reported by check_packs, naming the molecule), so unchecked packs cost no extra pass."""
    lay = layout
    B, K = lay.packs_per_batch, len(pack_lengths) // lay.packs_per_batch
    N, G, half = B * lay.max_nodes, B * lay.max_graphs, B * (lay.max_edges or 0) // 2
    with_forces = arrays.forces is not None
    radius = lay.max_edges is not None
    with_cells, with_shifts = arrays.cell is not None, radius and arrays.pair_shift is not None
    with_stress = arrays.stress is not None
    with_masks = [getattr(arrays, name) is not None for name in ("forces_mask", "stress_mask")]
    fields = {
        "z": output((K, N), torch.int64),
        "pos": output((K, N, 3), torch.float32),
        "forces": output((K, N, 3), torch.float32) if with_forces else torch.empty(0, 0, 3),
        "graph": output((K, N), torch.int64),
        "node_mask": output((K, N), torch.bool),
        "y": output((K, G), torch.float32),
        "graph_mask": output((K, G), torch.bool),
        "molecule_index": output((K, G), torch.int64),
        "edge_index": output((K, 2, 2 * half), torch.int64),
        "edge_mask": output((K, 2 * half), torch.bool),
        "edge_shift": output((K, 2 * half, 3), torch.int32)
        if with_shifts
        else _none(3, dtype=torch.int32),
        "cell": output((K, G, 3, 3), torch.float32) if with_cells else _none(3, 3),
        "stress": output((K, G, 3, 3), torch.float32) if with_stress else _none(3, 3),
        **{
            name: output((K, G), torch.bool) if present else _none(dtype=torch.bool)
            for name, present in zip(("forces_mask", "stress_mask"), with_masks)
        },
    }
    no_pairs = torch.zeros(0, dtype=torch.int64)
    sources = [
        arrays.z,
        arrays.pos,
        arrays.forces if with_forces else torch.empty(0, 3),
        arrays.y,
        no_pairs if arrays.store_index is None else arrays.store_index,
        arrays.atom_start,
        arrays.num_atoms,
        arrays.pair_ij if radius else torch.zeros(0, 2, dtype=torch.int16),
        arrays.pair_start if radius else no_pairs,
        arrays.pair_count if radius else no_pairs,
        arrays.pair_shift if with_shifts else _none(3, dtype=torch.int8)[0],
        arrays.cell if with_cells else _none(3, 3)[0],
        arrays.stress if with_stress else _none(3, 3)[0],
        *(
            getattr(arrays, name) if present else _none(dtype=torch.bool)[0]
            for name, present in zip(("forces_mask", "stress_mask"), with_masks)
        ),
        molecules,
        pack_lengths,
    ]
    sizes = (B, lay.max_nodes, lay.max_graphs, lay.max_edges or 0)
    status = compiled_feed.fill_chunk(
        *map(compiled_feed.as_numpy, sources),
        *sizes,
        PADDING_ORIGIN,
        PADDING_SPACING,
        *map(compiled_feed.as_numpy, fields.values()),
    )
    if status == compiled_feed.BAD_MOLECULES:
        raise LoaderError(
            f"{len(molecules)} molecules for packs of {int(pack_lengths.sum())}, or indices "
            f"outside 0..{len(arrays.num_atoms) - 1}"
        )
    if status != compiled_feed.FITS:
        check_packs(arrays, layout, molecules, pack_lengths)  # raises, naming the molecule
        raise LoaderError(f"a pack is over its limits (code {status})")
    if not with_forces:
        fields["forces"] = None
    if not radius:
        fields["edge_index"] = fields["edge_mask"] = None
    if not with_shifts:
        fields["edge_shift"] = None
    if not with_cells:
        fields["cell"] = None
    if not with_stress:
        fields["stress"] = None
    for name, present in zip(("forces_mask", "stress_mask"), with_masks):
        if not present:
            fields[name] = None
    return Assembled(**fields)


def _none(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """An empty [1, 0, *shape] tensor: an absent output (or, row 0, source) of the loop."""
    return torch.empty(1, 0, *shape, dtype=dtype)


def _edges(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack: Tensor,
    pack_lengths: Tensor,
    pairs: Tensor,
    pack_pairs: Tensor,
    atom_offset: Tensor,
    padding: Tensor,
    output: _Outputs,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """edge_index int64 [K, 2, E], edge_mask bool [K, E] and (periodic pairs) edge_shift
    int32 [K, E, 3] of the molecules' pairs (``pairs`` [T] per molecule,
    ``pack_lengths``/``pack_pairs`` [K * B] per pack).

    Each batch's forward pairs fill columns [0, its pairs) of the first half in molecule
    order, the reversed pairs the same columns of the second half; the rest join the batch's
    first padding atom (atom 0 when it has none) to itself.
    """
    B, size = layout.packs_per_batch, layout.max_nodes
    K, half = padding.shape[0], B * layout.max_edges // 2
    batch_pairs = pack_pairs.view(K, B).sum(1)
    batch_molecules = pack_lengths.view(K, B).sum(1)
    columns = _PaddedRuns(pack // B, pairs, batch_molecules, batch_pairs, half)  # K * half each
    starts = arrays.pair_start.index_select(0, molecules)
    source = columns.ranges(starts, len(arrays.pair_ij) - 1)
    filler = padding.to(torch.uint8).argmax(1)  # first padding atom, 0 when there is none
    # Both atoms of a pair travel as one integer twice as wide as a batch's atom rows, so
    # one gather, one add and one same-dtype pass serve both (no carry: rows < 2**15 or 2**31)
    node = _node_dtype(B * size)
    first_atom = (pack % B * size + atom_offset).to(node)
    both = torch.stack([first_atom, first_atom], 1).view(_TWICE_AS_WIDE[node]).view(-1)
    padding_both = torch.stack([filler.to(node), filler.to(node)], 1).view(both.dtype).view(-1)
    rows = columns.repeat(both, padding_both, both.dtype)  # [K * half] first atom, twice
    table = arrays.pair_ij.view(_TWICE_AS_WIDE[arrays.pair_ij.dtype]).view(-1)
    local = table.index_select(0, source).view(arrays.pair_ij.dtype).view(-1, 2).to(node)
    atoms = local.view(both.dtype).view(-1).add_(rows).view(node).view(K, half, 2)  # (i, j)
    edge_index = output((K, 2, 2, half), torch.int64)  # [batch, row, direction, column]
    for row, direction, atom in [(0, 0, 0), (1, 0, 1), (0, 1, 1), (1, 1, 0)]:
        edge_index[:, row, direction] = atoms[..., atom]
    # Row k of the mask (per direction) is batch_pairs[k] True then False: row half - p of the
    # sliding windows over [True] * half + [False] * half. Copying rows beats comparing (6x).
    edge_mask = output((K, 2, half), torch.bool)
    template = torch.arange(2 * half, device=pairs.device) < half
    rows_of_mask = template.unfold(0, half, 1)[half - batch_pairs]  # [K, half]
    edge_mask.copy_(rows_of_mask.unsqueeze(1).expand(K, 2, half))
    edge_shift = None
    if arrays.pair_shift is not None:  # S forward, -S reversed; padding pairs read 0
        edge_shift = output((K, 2, half, 3), torch.int32)
        forward = arrays.pair_shift.index_select(0, source).view(K, half, 3)
        edge_shift[:, 0] = forward
        torch.neg(edge_shift[:, 0], out=edge_shift[:, 1])
        edge_shift = edge_shift.view(K, 2 * half, 3)
    return edge_index.view(K, 2, 2 * half), edge_mask.view(K, 2 * half), edge_shift


def _check_fits(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack_lengths: Tensor,
    pack_atoms: Tensor,
    pack_pairs: Tensor | None,
) -> None:
    """LoaderError for a molecule too large for any pack, or a pack over its limits, given
    each pack's molecules, atoms and (radius graphs) pairs, [K * B] each. One test when all
    fit (a molecule over a limit puts its pack over it); the failing molecule is then found."""
    lay = layout
    over = (pack_atoms > lay.max_nodes) | (pack_lengths > lay.max_graphs)
    if pack_pairs is not None:
        over |= 2 * pack_pairs > lay.max_edges
    if not bool(over.any()):
        return
    pack = torch.repeat_interleave(torch.arange(len(pack_lengths)), pack_lengths.cpu())
    molecules, first = molecules.cpu(), _exclusive_cumsum(pack_lengths.cpu())
    n = arrays.num_atoms.cpu()[molecules]
    checks = [(n, "atoms", "max_nodes", lay.max_nodes)]
    if pack_pairs is not None:
        checks.append((2 * arrays.pair_count.cpu()[molecules], "edges", "max_edges", lay.max_edges))
    for own, what, key, limit in checks:
        too_big = torch.nonzero(own > limit)
        if len(too_big):
            t = int(too_big[0, 0])
            raise LoaderError(
                f"{arrays.name(int(molecules[t]))} has {int(own[t])} {what}, more than a pack "
                f"holds ({key}={limit}); raise packing.{key} or drop the molecule"
            )
        running = own.cumsum(0)
        in_pack = running - (running - own)[first[pack]]  # the pack's total up to each molecule
        reached = torch.nonzero(in_pack > limit)
        if len(reached):
            t = int(reached[0, 0])
            raise LoaderError(
                f"pack {int(pack[t]) % lay.packs_per_batch} holds {int(in_pack[t])} {what} > "
                f"{limit} ({key}), reached at {arrays.name(int(molecules[t]))}"
            )
    p = int(torch.nonzero(pack_lengths.cpu() > lay.max_graphs)[0, 0])
    raise LoaderError(
        f"pack {p % lay.packs_per_batch} holds more than {lay.max_graphs} molecules (max_graphs)"
    )
