"""The radius-pair search of the pairs file (:mod:`schnet_ipu.data.pairs`) as a compiled loop
(numba, when installed): every molecule's pairs in one pass over its n(n-1)/2 distances, with
:func:`schnet_ipu.data.graphs.within_cutoff`'s float32 test. Compiled at import (cached beside
this file); without numba ``AVAILABLE`` is False and the pairs file uses torch instead.
"""

from __future__ import annotations

try:
    import numba
except ImportError:  # schnet_ipu.data.pairs searches with torch instead
    numba = None

AVAILABLE = numba is not None


def _find_pairs(x, y, z, starts, sizes, limit, counts, pairs):
    """Every molecule r's pairs (i, j) within the cutoff, i < j, i then j, written one
    molecule after the other into ``pairs`` int32 [room, 2] (room for all n(n-1)/2 pairs of
    every molecule); ``counts[r]``: how many molecule r has. Molecule r: atoms ``starts[r]``
    onwards, ``sizes[r]`` of them, coordinates ``x``, ``y``, ``z`` float32 [A]; ``limit``:
    the float32 square of the cutoff. Returns the pairs written. The test is that of
    :func:`schnet_ipu.data.graphs.within_cutoff`, bit for bit: float32 differences, squares
    summed x, y, z in that order, ``<= limit``."""
    row = 0
    for r in range(len(sizes)):
        s, n, before = starts[r], sizes[r], row
        for i in range(n):
            for j in range(i + 1, n):
                dx, dy, dz = x[s + i] - x[s + j], y[s + i] - y[s + j], z[s + i] - z[s + j]
                if dx * dx + dy * dy + dz * dz <= limit:
                    pairs[row, 0], pairs[row, 1] = i, j
                    row += 1
        counts[r] = row - before
    return row


def _pairs_signature():
    """The pair loop's one signature: float32 [A] x, y, z, int64 runs, the float32 limit."""
    t = numba.types
    coords, runs = t.Array(t.float32, 1, "C"), t.Array(t.int64, 1, "C")
    return t.int64(*[coords] * 3, runs, runs, t.float32, runs, t.Array(t.int32, 2, "C"))


find_pairs = None
if AVAILABLE:  # releases the GIL: runs of molecules are searched on several threads
    find_pairs = numba.njit(_pairs_signature(), nogil=True, cache=True, boundscheck=False)(
        _find_pairs
    )
