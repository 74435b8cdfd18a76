"""Packs against the layout's limits: per-pack totals, and the error that names the
molecule (index and record id) or the pack over a limit.

Packs are given flat as the assembly takes them (:func:`schnet_ipu.feed.assembly.assemble`):
molecules int64 [T] in pack order and pack lengths int64 [K * B].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from schnet_ipu.feed.arrays import FeedArrays
from schnet_ipu.feed.layout import Layout, LoaderError


class PackTotals(NamedTuple):
    """Per molecule T and per pack P of packs given flat (molecules in pack order)."""

    pack: Tensor  # int64 [T] flat pack of each molecule
    atoms: Tensor  # int64 [T] atoms of each molecule
    pairs: Tensor | None  # int64 [T] radius pairs of each molecule (radius graphs only)
    pack_atoms: Tensor  # int64 [P]
    pack_pairs: Tensor | None  # int64 [P] (radius graphs only)


def pack_totals(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor
) -> PackTotals:
    """Each molecule's pack, atoms and pairs, and each pack's atoms and pairs (no host read)."""
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
    return PackTotals(pack, atoms, pairs, pack_atoms, pack_pairs)


def check_packs(
    arrays: FeedArrays, layout: Layout, molecules: Tensor, pack_lengths: Tensor
) -> None:
    """LoaderError naming the molecule (index and record id) when one molecule exceeds the
    pack's atom or edge limit, or the pack when its molecules together do (packs given as
    to :func:`~schnet_ipu.feed.assembly.assemble`). One host read of the device: the loader
    checks a whole epoch at once, so that on a GPU no chunk waits for the steps queued
    before it."""
    totals = pack_totals(arrays, layout, molecules, pack_lengths)
    check_fits(arrays, layout, molecules, pack_lengths, totals.pack_atoms, totals.pack_pairs)


def check_fits(
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
    molecules, first = molecules.cpu(), exclusive_cumsum(pack_lengths.cpu())
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


def exclusive_cumsum(counts: Tensor) -> Tensor:
    """[S] -> [S]: the sum of the counts before each (where each one's run starts)."""
    return counts.cumsum(0) - counts
