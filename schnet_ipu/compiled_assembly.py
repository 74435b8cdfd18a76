"""Assembly by the compiled loop: a CPU chunk filled by
:func:`schnet_ipu.compiled_feed.fill_chunk` (numba) instead of the torch program of
:mod:`schnet_ipu.assembly`, byte for byte alike. Here the chunk's tensors and the feed
arrays are handed to the loop as numpy views, absent fields as empty stand-ins, and the
loop's status becomes the error that names the molecule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from schnet_ipu import compiled_feed
from schnet_ipu.batch_layout import PADDING_ORIGIN, PADDING_SPACING, Layout, LoaderError
from schnet_ipu.chunk import Assembled, ChunkOutputs
from schnet_ipu.feed_arrays import FeedArrays
from schnet_ipu.pack_limits import check_packs


def fill_compiled(
    arrays: FeedArrays,
    layout: Layout,
    molecules: Tensor,
    pack_lengths: Tensor,
    output: ChunkOutputs,
) -> Assembled:
    """:func:`~schnet_ipu.assembly.assemble` by the compiled loop: CPU ``arrays``, packs as
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
