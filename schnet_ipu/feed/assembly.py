"""Batches as array programs: many fixed-shape batches from a few gathers over flat arrays.

:func:`assemble` turns K batches worth of packs, given flat (molecules in pack order, pack
lengths), into an :class:`~schnet_ipu.feed.chunk.Assembled` chunk of [K, ...] tensors over a
split's :class:`~schnet_ipu.feed.arrays.FeedArrays`, with no Python loop over molecules or
packs; the loader hands out its rows as :class:`~schnet_ipu.batch.Batch` views. On the CPU
the compiled loop fills the chunk instead (:mod:`schnet_ipu.feed.compiled`), byte for
byte alike; the torch program here also runs on a GPU when the data is device-resident.
:func:`assemble_batch` is the same for one batch whose packs are given as index lists.

Radius edges keep the order of a per-pack search: pack, then i, then j (i < j), forward
pairs first, then the same pairs reversed (see schnet_ipu.batch). Periodic stores (with
cells) add each pair's integer cell shift S (the reversed pair gets -S) and each molecule
slot's cell. Stores with partial labels add each slot's ``forces_mask`` / ``stress_mask``
(False on padding slots).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch
from schnet_ipu.feed import compiled as compiled_loop
from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.chunk import Assembled, ChunkOutputs, OutputBuffers, unstack
from schnet_ipu.feed.layout import PADDING_ORIGIN, PADDING_SPACING, Layout, LoaderError
from schnet_ipu.feed.limits import check_fits, exclusive_cumsum, pack_totals

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
        self.first = exclusive_cumsum(self.interleave(lengths, width - used))  # [runs]

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

    Raises LoaderError as :func:`~schnet_ipu.feed.limits.check_packs` does, unless
    ``checked`` (the caller checked these packs). ``pin``: allocate the CPU outputs in pinned
    memory (for non-blocking copies to CUDA); else ``buffers``: CPU outputs go to memory from
    there. ``compiled``: fill CPU batches by :mod:`schnet_ipu.feed.compiled`'s loop (None:
    when numba is installed) rather than by the torch program below; both give the same
    bytes.
    """
    K = len(pack_lengths) // layout.packs_per_batch
    nbytes = K * arrays.batch_bytes(layout)
    output = ChunkOutputs(nbytes, arrays.device, pin, buffers)
    if compiled is None:
        compiled = compiled_loop.AVAILABLE
    if compiled and arrays.device.type == "cpu":
        return compiled_loop.fill_compiled(arrays, layout, molecules, pack_lengths, output)
    lay, dev = layout, arrays.device
    B, size, slots = lay.packs_per_batch, lay.max_nodes, lay.max_graphs
    N, G = B * size, B * slots
    count = len(molecules)
    pack, n, pairs, pack_atoms, pack_pairs = pack_totals(arrays, layout, molecules, pack_lengths)
    if not checked:
        check_fits(arrays, layout, molecules, pack_lengths, pack_atoms, pack_pairs)
    pack_first = exclusive_cumsum(pack_lengths)[pack]  # [T] first molecule of each one's pack
    slot = torch.arange(count, device=dev) - pack_first
    first_atom = exclusive_cumsum(n)
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


def assemble_batch(
    arrays: FeedArrays, layout: Layout, packs: Sequence[Sequence[int] | np.ndarray]
) -> Batch:
    """One Batch of ``layout`` from at most ``layout.packs_per_batch`` packs, each a list of
    indices into ``arrays``; fewer packs leave the rest empty (all padding). Raises
    LoaderError as :func:`assemble` does."""
    if len(packs) > layout.packs_per_batch:
        raise LoaderError(f"{len(packs)} packs for a batch of {layout.packs_per_batch}")
    device = arrays.device
    lengths = torch.zeros(layout.packs_per_batch, dtype=torch.int64)
    lengths[: len(packs)] = torch.tensor([len(p) for p in packs], dtype=torch.int64)
    molecules = torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *packs]).astype(np.int64))
    return unstack(assemble(arrays, layout, molecules.to(device), lengths.to(device)))[0]


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
    output: ChunkOutputs,
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
