"""The CPU feed's compiled assembly (numba, when installed): one loop per chunk of batches.

:func:`schnet_ipu.feed.assembly.assemble` builds a chunk of batches from a few whole-chunk torch
ops (gathers, cumsums), which is also what runs on a GPU when the data is device-resident. On a
CPU those ops pass over every edge five times (two run expansions, a gather, an add, the
write) and the epoch stays memory-bound at ~3x the cost of writing the batches once. Here
one loop per batch walks its packs and molecules and writes every output entry once: the
same bytes, bit for bit (a test compares both programs), in 45-55% of the time on the
2-core dev box. The loop releases the GIL, so the loader's threads fill chunks in parallel.
:func:`fill_compiled` hands the loop the chunk's tensors and the feed arrays as numpy views
(absent fields as empty stand-ins) and turns its status into the error that names the
molecule.

The loop is compiled when this module is imported (numba: ~2 s per dtype of the pair table
the first time, cached beside this file; ~0.6 s to load from the cache in a new process), so
the first epoch does not wait for it. Without numba (``AVAILABLE`` is False: e.g. an image
where it cannot be installed) the torch program runs on the CPU too.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

try:
    import numba
except ImportError:  # the torch program serves instead (schnet_ipu.feed.assembly)
    numba = None

from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.chunk import Assembled, ChunkOutputs
from schnet_ipu.feed.layout import PADDING_ORIGIN, PADDING_SPACING, Layout, LoaderError
from schnet_ipu.feed.limits import check_packs

AVAILABLE = numba is not None

# Codes fill_chunk returns for packs it cannot hold (the caller reports which molecule).
FITS, TOO_MANY_ATOMS, TOO_MANY_MOLECULES, TOO_MANY_EDGES, BAD_MOLECULES = range(5)


def _fill_chunk(
    z_source, pos_source, forces_source, y_source, index_source, atom_start, num_atoms,
    pair_ij, pair_start, pair_count, pair_shift, cell_source, stress_source,
    forces_mask_source, stress_mask_source, molecules, pack_lengths,
    packs_per_batch, max_nodes, max_graphs, max_edges, padding_origin, padding_spacing,
    z, pos, forces, graph, node_mask, y, graph_mask, molecule_index, edge_index, edge_mask,
    edge_shift, cell, stress, forces_mask, stress_mask,
):  # fmt: skip
    """Fill K batches (the outputs, [K, ...] as :class:`schnet_ipu.feed.chunk.Assembled`) from
    packs given flat: ``molecules`` [T] in pack order, ``pack_lengths`` [K * B].

    Sources, M molecules of A atoms: ``z_source`` uint8 [A + 1], ``pos_source`` float32
    [A + 1, 3], ``forces_source`` float32 [A + 1, 3] or [0, 3] (no forces), ``y_source``
    float32 [M], ``index_source`` int64 [M] (or [0]: a molecule's index is its own),
    ``atom_start``/``num_atoms`` int64 [M], ``pair_ij`` [P + 1, 2] local (i, j),
    ``pair_start``/``pair_count`` int64 [M] (radius graphs; ``max_edges`` = 0 for knn
    graphs, whose edge outputs are [K, 2, 0] and [K, 0]); periodic stores: ``pair_shift``
    int8 [P + 1, 3] and ``cell_source`` float32 [M, 3, 3], written to ``edge_shift`` int32
    [K, E, 3] (S forward, -S reversed, 0 on padding) and ``cell`` float32 [K, G, 3, 3]
    (0 on empty slots); stores with stress: ``stress_source`` float32 [M, 3, 3] to
    ``stress`` [K, G, 3, 3] (0 on empty slots); stores with partial labels:
    ``forces_mask_source`` / ``stress_mask_source`` bool [M] to ``forces_mask`` /
    ``stress_mask`` bool [K, G] (False on empty slots); [0], [0, 3] / [0, 3, 3] sources mean
    none (outputs then unused).
    Returns FITS; BAD_MOLECULES for
    an index outside 0..M-1 or pack lengths that do not add up to T (nothing written); or
    the code of the first limit a pack breaks (the checks of pack_limits.check_packs; nothing past
    a limit is written).
    """
    count, half = len(num_atoms), packs_per_batch * max_edges // 2
    with_forces = forces_source.shape[0] > 0
    with_cells, with_shifts = cell_source.shape[0] > 0, pair_shift.shape[0] > 0
    with_stress = stress_source.shape[0] > 0
    with_forces_mask = forces_mask_source.shape[0] > 0
    with_stress_mask = stress_mask_source.shape[0] > 0
    # Pass 1: what each molecule needs, gathered first. These loads do not depend on each
    # other, so the CPU overlaps their cache misses; in the writing loop they stalled it
    # (this pass makes the whole loop ~20% faster on QM9).
    if np.sum(pack_lengths[: z.shape[0] * packs_per_batch]) != len(molecules):
        return BAD_MOLECULES
    where = np.empty((len(molecules), 6), np.int64)  # atoms, pairs (from, count), index, m
    targets = np.empty(len(molecules), np.float32)
    for t in range(len(molecules)):
        m = molecules[t]
        if m < 0 or m >= count:
            return BAD_MOLECULES
        where[t, 0], where[t, 1], targets[t] = atom_start[m], num_atoms[m], y_source[m]
        where[t, 4] = index_source[m] if len(index_source) else m
        where[t, 5] = m
        if half:
            where[t, 2], where[t, 3] = pair_start[m], pair_count[m]
    # Pass 2: the batches, pack after pack, molecule after molecule.
    t = 0  # the next molecule
    for k in range(z.shape[0]):
        column = 0  # the batch's forward pairs so far
        padding = 0  # the batch's padding atoms so far
        filler = 0  # the batch's first padding atom (padding edges join it to itself)
        for b in range(packs_per_batch):
            molecules_in_pack = pack_lengths[k * packs_per_batch + b]
            if molecules_in_pack > max_graphs:
                return TOO_MANY_MOLECULES
            row, end = b * max_nodes, (b + 1) * max_nodes
            pack_pairs = 0
            for s in range(max_graphs):
                slot = b * max_graphs + s
                if s >= molecules_in_pack:  # an empty molecule slot
                    y[k, slot], graph_mask[k, slot], molecule_index[k, slot] = 0.0, False, -1
                    if with_cells:
                        cell[k, slot] = 0.0
                    if with_stress:
                        stress[k, slot] = 0.0
                    if with_forces_mask:
                        forces_mask[k, slot] = False
                    if with_stress_mask:
                        stress_mask[k, slot] = False
                    continue
                y[k, slot], graph_mask[k, slot] = targets[t], True
                molecule_index[k, slot] = where[t, 4]
                if with_cells:
                    cell[k, slot] = cell_source[where[t, 5]]
                if with_stress:
                    stress[k, slot] = stress_source[where[t, 5]]
                if with_forces_mask:
                    forces_mask[k, slot] = forces_mask_source[where[t, 5]]
                if with_stress_mask:
                    stress_mask[k, slot] = stress_mask_source[where[t, 5]]
                first, n = where[t, 0], where[t, 1]
                if row + n > end:
                    return TOO_MANY_ATOMS
                for a in range(n):
                    z[k, row + a] = z_source[first + a]
                    for c in range(3):
                        pos[k, row + a, c] = pos_source[first + a, c]
                        if with_forces:
                            forces[k, row + a, c] = forces_source[first + a, c]
                    graph[k, row + a], node_mask[k, row + a] = slot, True
                if half:
                    p, pairs = where[t, 2], where[t, 3]
                    pack_pairs += pairs
                    if 2 * pack_pairs > max_edges:
                        return TOO_MANY_EDGES
                    for q in range(pairs):  # forward (i, j) in the first half, (j, i) after
                        i, j = pair_ij[p + q, 0] + row, pair_ij[p + q, 1] + row
                        edge_index[k, 0, column + q], edge_index[k, 1, column + q] = i, j
                        edge_index[k, 0, half + column + q] = j
                        edge_index[k, 1, half + column + q] = i
                        if with_shifts:
                            for c in range(3):
                                edge_shift[k, column + q, c] = pair_shift[p + q, c]
                                edge_shift[k, half + column + q, c] = -pair_shift[p + q, c]
                    column += pairs
                row += n
                t += 1
            for r in range(row, end):  # padding atoms, on a line far from everything
                if padding == 0:
                    filler = r
                z[k, r], graph[k, r], node_mask[k, r] = 0, packs_per_batch * max_graphs, False
                pos[k, r, 0] = padding_origin + padding_spacing * padding
                pos[k, r, 1], pos[k, r, 2] = 0.0, 0.0
                if with_forces:
                    forces[k, r, 0], forces[k, r, 1], forces[k, r, 2] = 0.0, 0.0, 0.0
                padding += 1
        for q in range(half):
            if q >= column:
                edge_index[k, 0, q], edge_index[k, 1, q] = filler, filler
                edge_index[k, 0, half + q], edge_index[k, 1, half + q] = filler, filler
                if with_shifts:
                    edge_shift[k, q] = 0
                    edge_shift[k, half + q] = 0
            edge_mask[k, q] = edge_mask[k, half + q] = q < column
    return FITS


def _chunk_signature(pair_dtype):
    """The loop's signature for one pair-table dtype (it is compiled for int16 and int32)."""
    t = numba.types
    i64, f32 = t.int64, t.float32
    sources = [
        _array(t.uint8, 1), _array(f32, 2), _array(f32, 2), _array(f32, 1),
        *[_array(i64, 1)] * 3, _array(pair_dtype, 2), *[_array(i64, 1)] * 2,
        _array(t.int8, 2), _array(f32, 3), _array(f32, 3), *[_array(t.boolean, 1)] * 2,
        *[_array(i64, 1)] * 2,
    ]  # fmt: skip
    sizes = [i64] * 4 + [t.float64] * 2
    outputs = [
        _array(i64, 2), _array(f32, 3), _array(f32, 3), _array(i64, 2), _array(t.boolean, 2),
        _array(f32, 2), _array(t.boolean, 2), _array(i64, 2), _array(i64, 3),
        _array(t.boolean, 2), _array(t.int32, 3), _array(f32, 4), _array(f32, 4),
        *[_array(t.boolean, 2)] * 2,
    ]  # fmt: skip
    return i64(*sources, *sizes, *outputs)


def _array(dtype, ndim: int):
    return numba.types.Array(dtype, ndim, "C")


def as_numpy(values: Tensor) -> np.ndarray:
    """A CPU tensor as the C-contiguous numpy array (a view) the loop reads or writes."""
    array = values.numpy()
    if not array.flags.c_contiguous:
        raise ValueError("feed.compiled: arrays must be C-contiguous")
    return array


# Compiled at import (the loop releases the GIL: chunks are filled on several threads).
fill_chunk = None
if AVAILABLE:
    fill_chunk = numba.njit(
        [_chunk_signature(numba.types.int16), _chunk_signature(numba.types.int32)],
        nogil=True,
        cache=True,
        boundscheck=False,
    )(_fill_chunk)


def fill_compiled(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack_lengths: Tensor,
    output: ChunkOutputs,
) -> Assembled:
    """:func:`~schnet_ipu.feed.assembly.assemble` by the compiled loop: CPU ``arrays``, packs as
    assemble takes them, into ``output``. The loop checks every pack as :func:`check_packs`
    does (a pack it cannot hold is then reported by check_packs, naming the molecule), so
    unchecked packs cost no extra pass."""
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
    status = fill_chunk(
        *map(as_numpy, sources),
        *sizes,
        PADDING_ORIGIN,
        PADDING_SPACING,
        *map(as_numpy, fields.values()),
    )
    if status == BAD_MOLECULES:
        raise LoaderError(
            f"{len(molecules)} molecules for packs of {int(pack_lengths.sum())}, or indices "
            f"outside 0..{len(arrays.num_atoms) - 1}"
        )
    if status != FITS:
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
