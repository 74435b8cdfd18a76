"""Compiled CPU loops (numba) over the pairs of one structure, for inference without
autograd (:mod:`schnet_ipu.model.direct_forces`): the pairs of a molecule, each pair's
position on the filter table, and the forces and strain derivative from the energy's
gradient with respect to those positions.

Pairs are a half list: pair p joins receiver ``i[p]`` and source ``j[p]`` with the edge
vector ``r_p = pos[j] - pos[i] + shift[p] @ cell`` (no shift for a molecule). With the
table's grid ``s_p = |r_p| scale`` (``scale = (K - 1) / cutoff``), interval
``k_p = clamp(floor(s_p), 0, K - 2)`` and position ``t_p = s_p - k_p``, an energy gradient
``g_p = dE/dt_p`` gives ``dE/dr_p = g_p scale r_p / |r_p|``, the forces
``F[i] += dE/dr_p``, ``F[j] -= dE/dr_p`` and ``dE/deps = sum_p r_p (x) dE/dr_p``.

Geometry is done in float64 whatever the model's precision (positions of a large cell keep
their digits); ``t`` is written in the model's dtype. Compiled on first use (cached beside
this file), one thread.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the torch path serves instead
    numba = None

AVAILABLE = numba is not None


def _count_close(pos, cutoff_sq):  # pragma: no cover
    """Number of pairs a < b of ``pos`` [N, 3] within the cutoff."""
    n, count = pos.shape[0], 0
    for a in range(n):
        for b in range(a + 1, n):
            dx, dy, dz = pos[b, 0] - pos[a, 0], pos[b, 1] - pos[a, 1], pos[b, 2] - pos[a, 2]
            if dx * dx + dy * dy + dz * dz <= cutoff_sq:
                count += 1
    return count


def molecule_pairs(pos, cutoff):  # pragma: no cover
    """(i, j) int64 [P] of every pair i < j of ``pos`` [N, 3] (float64) within ``cutoff``:
    all N (N - 1) / 2 distances, counted then written (faster than a cell list below a
    few thousand atoms)."""
    cutoff_sq = cutoff * cutoff
    count = _count_close(pos, cutoff_sq)
    i, j = np.empty(count, np.int64), np.empty(count, np.int64)
    n, p = pos.shape[0], 0
    for a in range(n):
        for b in range(a + 1, n):
            dx, dy, dz = pos[b, 0] - pos[a, 0], pos[b, 1] - pos[a, 1], pos[b, 2] - pos[a, 2]
            if dx * dx + dy * dy + dz * dz <= cutoff_sq:
                i[p], j[p] = a, b
                p += 1
    return i, j


def pair_geometry(pos, i, j, shift, cell, scale, last, vec, dist, interval, t):  # pragma: no cover
    """Fill ``vec`` [P, 3] and ``dist`` [P] (float64), ``interval`` [P] (int64) and ``t``
    [P] (the model's dtype); ``shift`` [P, 3] float64, or [0, 3] for a molecule; ``last``
    = K - 2, the last interval."""
    periodic = shift.shape[0] > 0
    for p in range(i.shape[0]):
        a, b = i[p], j[p]
        for axis in range(3):
            v = pos[b, axis] - pos[a, axis]
            if periodic:
                v += shift[p, 0] * cell[0, axis] + shift[p, 1] * cell[1, axis]
                v += shift[p, 2] * cell[2, axis]
            vec[p, axis] = v
        d = np.sqrt(vec[p, 0] ** 2 + vec[p, 1] ** 2 + vec[p, 2] ** 2)
        dist[p] = d
        s = d * scale
        k = min(max(np.floor(s), 0.0), last)
        interval[p] = np.int64(k)
        t[p] = s - k


def pair_forces(i, j, vec, dist, grad_t, scale, forces, dE_deps):  # pragma: no cover
    """Add ``-dE/dpos`` into ``forces`` [N, 3] and ``sum_p r_p (x) dE/dr_p`` into ``dE_deps``
    [3, 3] (both float64) from ``grad_t`` [P] = dE/dt_p; a pair at zero distance adds
    nothing."""
    for p in range(i.shape[0]):
        if dist[p] <= 0.0:
            continue
        along = grad_t[p] * scale / dist[p]
        a, b = i[p], j[p]
        for axis in range(3):
            g = along * vec[p, axis]
            forces[a, axis] += g
            forces[b, axis] -= g
            for other in range(3):
                dE_deps[other, axis] += vec[p, other] * g


def table_slope_sum(x, grad, i, j, coeffs, interval, t, grad_t):  # pragma: no cover
    """Add ``sum_f (x[j] G[i] + x[i] G[j]) W'`` into ``grad_t`` [P]: dE/dt of the pair-
    symmetric table convolution (``W' = dW/dt`` of pair p's cubic in ``coeffs``
    [K - 1, 4, F]), x, G = dE/d out [N, F]. The backward of the first block, whose input
    needs no gradient: :func:`~.fused_table_loops.backward_loop` without grad_x."""
    zero = np.zeros(1, dtype=x.dtype)[0]
    for p in range(interval.shape[0]):
        k, tp, a, b = interval[p], t[p], i[p], j[p]
        total = zero
        for f in range(x.shape[1]):
            c1, c2, c3 = coeffs[k, 1, f], coeffs[k, 2, f], coeffs[k, 3, f]
            slope = c1 + (c2 + c2 + (c3 + c3 + c3) * tp) * tp
            total += (x[b, f] * grad[a, f] + x[a, f] * grad[b, f]) * slope
        grad_t[p] += total


if AVAILABLE:
    _loop = numba.njit(nogil=True, cache=True, boundscheck=False)
    _count_close = _loop(_count_close)
    table_slope_sum = numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True)(
        table_slope_sum
    )
    molecule_pairs = _loop(molecule_pairs)
    pair_geometry = _loop(pair_geometry)
    pair_forces = _loop(pair_forces)
