"""LPFHP: longest-pack-first histogram packing of molecules by atom count.

Best-fit-decreasing on the size *histogram*: sizes are taken largest first, and each size
goes to the open packs with the least room that still fits it (the "longest" packs). Packs
with identical contents form one group with a count, so every step moves a whole block of
molecules at once instead of one molecule at a time.

The result equals item-by-item best-fit-decreasing: once a molecule of size ``s`` lands in
the tightest pack, that pack is still the tightest for the next molecule of size ``s``, so
it receives ``k`` copies (as many as fit) before the next pack of its group is touched.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from schnet_ipu.packing.strategy import PackingError, PackPlan, make_plan


def lpfhp(histogram: np.ndarray, max_nodes: int, max_graphs: int) -> PackPlan:
    """Pack ``histogram[s]`` molecules of ``s`` atoms (int [S]) into packs of ``max_nodes``
    atoms and at most ``max_graphs`` molecules. Templates list sizes in decreasing order."""
    histogram = np.asarray(histogram, dtype=np.int64)
    sizes = np.flatnonzero(histogram)
    if len(sizes) == 0 or histogram.min() < 0 or histogram[0] != 0:
        raise PackingError("histogram needs non-negative counts of molecules with >= 1 atom")
    if max_graphs < 1:
        raise PackingError(f"max_graphs={max_graphs} must be >= 1")
    if sizes[-1] > max_nodes:
        raise PackingError(
            f"molecules of {sizes[-1]} atoms exceed max_nodes={max_nodes}; "
            f"raise max_nodes to at least {sizes[-1]}"
        )
    smallest = int(sizes[0])
    # open_[room] = {template: packs}: packs that may still take a molecule, by free atoms
    open_: dict[int, dict[tuple[int, ...], int]] = defaultdict(dict)
    closed: dict[tuple[int, ...], int] = defaultdict(int)

    def add(template: tuple[int, ...], packs: int) -> None:
        room = max_nodes - sum(template)
        if len(template) == max_graphs or room < smallest:
            closed[template] += packs
        else:
            group = open_[room]
            group[template] = group.get(template, 0) + packs

    for size in sizes[::-1].tolist():
        left = int(histogram[size])
        while left:
            room = next((r for r in range(size, max_nodes + 1) if open_.get(r)), None)
            if room is None:  # nothing fits: open new, empty packs
                template, available, room = (), left, max_nodes
            else:
                group = open_[room]
                template = next(iter(group))
                available = group[template]
            per_pack = min(room // size, max_graphs - len(template))
            full = min(available, left // per_pack)
            rest = left - full * per_pack
            partial = full < available and rest > 0
            if template:
                group[template] -= full + int(partial)
                if not group[template]:
                    del group[template]
                if not group:
                    del open_[room]
            if full:
                add(template + (size,) * per_pack, full)
            if partial:
                add(template + (size,) * rest, 1)
            left = 0 if partial else rest

    packs: dict[tuple[int, ...], int] = dict(closed)
    for group in open_.values():
        for template, count in group.items():
            packs[template] = packs.get(template, 0) + count
    templates = sorted(packs, reverse=True)
    return make_plan("lpfhp", max_nodes, None, max_graphs, templates, [packs[t] for t in templates])
