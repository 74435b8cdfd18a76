"""HydroNet-scale synthetic water: rigid-body samples around relaxed TIP3P templates, streamed.

Relaxing every cluster (:func:`schnet_ipu.data.water.generate_water`) runs at ~5 clusters/s;
millions of clusters are made here instead, per cluster size w:

1. Templates: ``templates`` clusters of w waters relaxed with L-BFGS (``relax_clusters``),
   seeded by (seed, w); a template with atoms of different waters closer than
   ``MIN_CONTACT + TEMPLATE_MARGIN`` is dropped.
2. Samples: a template with every water moved as a rigid body (rotated about its O by a
   Gaussian angle of ``ROTATION_SIGMA`` rad, shifted by ``SHIFT_SIGMA`` A per axis), then the
   whole cluster rotated at random. Waters keep their exact TIP3P geometry.
3. Rejection: a sample with two atoms of different waters closer than ``MIN_CONTACT`` is
   drawn again (atoms of one water are >= 0.9572 A apart by construction).
4. Energy: the TIP3P interaction energy of the float32 positions that are stored (evaluated
   in float64), for a whole chunk of equal-size clusters at once (:func:`tip3p_batch`).

Chunks are written in size order with seeds (seed, w, chunk), so an interrupted run resumes
from its partial store (see :mod:`schnet_ipu.data.writer`) and writes the same bytes.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .checks import StoreError
from .water import CHARGES, COULOMB, LJ_EPSILON, LJ_SIGMA, relax_clusters, water_geometry
from .writer import StoreWriter

log = logging.getLogger(__name__)

MIN_CONTACT = 1.5  # Angstrom, closest allowed distance between atoms of different waters
TEMPLATE_MARGIN = 0.2  # Angstrom, templates keep this much room above MIN_CONTACT
ROTATION_SIGMA = 0.12  # rad, per-water rotation
SHIFT_SIGMA = 0.08  # Angstrom, per-water translation along each axis
TEMPLATE_ITERATIONS = 150  # L-BFGS iterations per template batch
CHUNK_ATOMS = 1_500_000  # atoms written per chunk (~18 MB of positions)
EVAL_PAIRS = 2_000_000  # atom pairs per vectorised energy evaluation (~16 MB per tensor)
MAX_REDRAWS = 100

# HydroNet (Choudhury et al. 2020, arXiv:2012.00131) as PyG ships it: "large" = W3-W30,
# 4,464,740 clusters (len(HydroNet(...)) printed in graphcore-research/hydronet-gnn,
# experiments/hydronet_packing.ipynb); "medium" = W3-W25, 2.7M clusters (PyG's HydroNet
# docstring). The per-size counts are not published with those totals, so HYDRONET_WEIGHTS
# spreads them: W3-W25 share 2.7M in proportion to (w - 2) (more low-lying minima for larger
# clusters), W26-W30 share the remaining 1,764,740 equally.
HYDRONET_LARGE = 4_464_740
HYDRONET_MEDIUM = 2_700_000


def hydronet_weights() -> dict[int, float]:
    """Share of HydroNet's clusters with w waters, w = 3..30 (derived, see the module)."""
    small = {w: HYDRONET_MEDIUM * (w - 2) / sum(range(1, 24)) for w in range(3, 26)}
    large = {w: (HYDRONET_LARGE - HYDRONET_MEDIUM) / 5 for w in range(26, 31)}
    return {w: v / HYDRONET_LARGE for w, v in {**small, **large}.items()}


def size_counts(
    clusters: int, sizes: Sequence[int], distribution: str = "uniform"
) -> dict[int, int]:
    """Clusters per water count, summing to ``clusters`` exactly (largest remainders).

    ``distribution`` "uniform" over ``sizes[0]..sizes[1]``, or "hydronet" (HydroNet's shares,
    restricted to that range and renormalised).
    """
    lo, hi = int(sizes[0]), int(sizes[1])
    if clusters < 1 or not 1 <= lo <= hi:
        raise StoreError(
            f"water: need clusters >= 1 and 1 <= min <= max sizes (--clusters, --sizes; "
            f"data.water_clusters, data.water_sizes), got {clusters}, {list(sizes)}"
        )
    if distribution == "uniform":
        weights = {w: 1.0 for w in range(lo, hi + 1)}
    elif distribution == "hydronet":
        weights = {w: p for w, p in hydronet_weights().items() if lo <= w <= hi}
        if not weights:
            raise StoreError(
                f"water: HydroNet has clusters of 3..30 waters, none in {lo}..{hi}; choose "
                "sizes within 3..30 or the uniform distribution"
            )
    else:
        raise StoreError(f"water: unknown size distribution {distribution!r} (uniform, hydronet)")
    share = np.array(list(weights.values())) / sum(weights.values()) * clusters
    counts = np.floor(share).astype(np.int64)
    counts[np.argsort(counts - share)[: clusters - counts.sum()]] += 1
    return {w: int(c) for w, c in zip(weights, counts) if c}


def random_rotations(rng: np.random.Generator, n: int, sigma: float | None) -> np.ndarray:
    """[n, 3, 3] rotations: about Gaussian axis-angle vectors of std ``sigma`` (rad per axis),
    or uniform over SO(3) when ``sigma`` is None."""
    if sigma is None:
        q = rng.normal(size=(n, 4))
        w, x, y, z = (q / np.linalg.norm(q, axis=1, keepdims=True)).T
        rows = [
            1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
            2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
            2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
        ]  # fmt: skip
        return np.stack(rows, axis=1).reshape(n, 3, 3)
    v = rng.normal(scale=sigma, size=(n, 3))
    angle = np.linalg.norm(v, axis=1)[:, None, None]
    k = v / np.maximum(angle[:, :, 0], 1e-300)
    cross = np.zeros((n, 3, 3))
    cross[:, 0, 1], cross[:, 0, 2], cross[:, 1, 2] = -k[:, 2], k[:, 1], -k[:, 0]
    cross -= cross.transpose(0, 2, 1)
    return np.eye(3) + np.sin(angle) * cross + (1 - np.cos(angle)) * cross @ cross


def tip3p_batch(pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Energy and closest contact of clusters of equal size.

    pos: [B, 3w, 3] atoms (O, H, H per water) in Angstrom, any float dtype (evaluated in
    float64). Returns (TIP3P interaction energy float64 [B] in kcal/mol, float64 [B] smallest
    distance between atoms of different waters).
    """
    batch, n = pos.shape[:2]
    waters = n // 3
    molecule = torch.arange(waters).repeat_interleave(3)
    inter = molecule[:, None] != molecule[None, :]
    charges = torch.tensor(CHARGES, dtype=torch.float64).repeat(waters)
    qq = torch.where(inter, COULOMB / 2 * charges[:, None] * charges[None, :], 0.0)
    off_diagonal = ~torch.eye(waters, dtype=torch.bool)
    energy, contact = np.empty(batch), np.empty(batch)
    step = max(1, EVAL_PAIRS // (n * n))
    for a in range(0, batch, step):
        x = torch.from_numpy(np.ascontiguousarray(pos[a : a + step], dtype=np.float64))
        r = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
        contact[a : a + step] = torch.where(inter, r, math.inf).amin(dim=(1, 2)).numpy()
        coulomb = (qq / (r + torch.eye(n, dtype=torch.float64))).sum(dim=(1, 2))
        r_oo = r[:, ::3, ::3] + torch.eye(waters, dtype=torch.float64)
        sr6 = torch.where(off_diagonal, (LJ_SIGMA / r_oo) ** 6, 0.0)
        lj = 2 * LJ_EPSILON * (sr6 * sr6 - sr6).sum(dim=(1, 2))
        energy[a : a + step] = (coulomb + lj).numpy()
    return energy, contact


class Templates:
    """Relaxed clusters of one size: O centres [T, w, 3] and orientations [T, w, 3, 3]."""

    def __init__(self, seed: int, waters: int, count: int) -> None:
        rng = np.random.default_rng([seed, waters, 0])
        atoms, _ = relax_clusters(rng, 2 * count, waters, max_iter=TEMPLATE_ITERATIONS)
        atoms = atoms.numpy()  # [2T, w, 3, 3]
        _, contact = tip3p_batch(atoms.reshape(len(atoms), -1, 3))
        good = np.flatnonzero(contact >= MIN_CONTACT + TEMPLATE_MARGIN)[:count]
        if len(good) == 0:
            raise StoreError(f"no relaxed {waters}-water template kept its contacts >= 1.7 A")
        atoms = atoms[good]
        self.centres = atoms[:, :, 0]
        body = water_geometry().numpy()  # [3, 3], O at the origin
        # orientation R with atoms - O = body @ R^T: solve from the two O-H vectors
        frame = np.stack([body[1], body[2], np.cross(body[1], body[2])])  # [3, 3]
        rel = atoms - atoms[:, :, :1]
        world = np.stack([rel[:, :, 1], rel[:, :, 2], np.cross(rel[:, :, 1], rel[:, :, 2])], -2)
        self.orientations = np.linalg.solve(frame, world).transpose(0, 1, 3, 2)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` perturbed clusters, float64 [count, 3w, 3]."""
        waters = self.centres.shape[1]
        pick = rng.integers(len(self.centres), size=count)
        turn = random_rotations(rng, count * waters, ROTATION_SIGMA).reshape(count, waters, 3, 3)
        rot = turn @ self.orientations[pick]
        centres = self.centres[pick] + rng.normal(scale=SHIFT_SIGMA, size=(count, waters, 3))
        atoms = centres[:, :, None] + np.einsum("cwij,aj->cwai", rot, water_geometry().numpy())
        atoms = atoms.reshape(count, 3 * waters, 3)
        atoms -= atoms.mean(axis=1, keepdims=True)
        return atoms @ random_rotations(rng, count, None).transpose(0, 2, 1)


def sample_chunk(
    templates: Templates, seed: int, waters: int, chunk: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``chunk`` of w-water clusters: (pos float32 [count, 3w, 3], energy [count])."""
    rng = np.random.default_rng([seed, waters, chunk + 1])
    pos = np.empty((count, 3 * waters, 3), dtype=np.float32)
    energy = np.empty(count)
    todo = np.arange(count)
    for _ in range(MAX_REDRAWS):
        pos[todo] = templates.sample(rng, len(todo))
        energy[todo], contact = tip3p_batch(pos[todo])
        todo = todo[contact < MIN_CONTACT]
        if len(todo) == 0:
            return pos, energy
    raise StoreError(f"{waters}-water samples kept closer contacts than {MIN_CONTACT} A")


def generate_water_sampled(
    out: str | Path,
    clusters: int,
    sizes: Sequence[int] = (3, 30),
    seed: int = 0,
    templates: int = 16,
    distribution: str = "hydronet",
    workers: int = 0,
    progress: bool = True,
) -> Path:
    """Generate ``clusters`` TIP3P water clusters (sampled around relaxed templates) into a
    store at ``out``, streamed chunk by chunk and resumable (see the module docstring).

    ``workers`` > 0 samples chunks in that many processes (the store is the same). Ids are
    0..M-1 in store order (by size, then as sampled). Target ``energy`` in kcal/mol.
    """
    if templates < 1 or workers < 0:  # before the writer makes its partial file
        raise StoreError(
            f"{out}: need templates >= 1 and workers >= 0 (--templates, data.water_templates), "
            f"got {templates}, {workers}"
        )
    counts = size_counts(clusters, sizes, distribution)
    num_atoms = np.concatenate([np.full(c, 3 * w, dtype=np.int64) for w, c in counts.items()])
    params = {
        "generator": "water_sampled/1",
        "clusters": clusters,
        "sizes": [int(sizes[0]), int(sizes[1])],
        "seed": seed,
        "templates": templates,
        "distribution": distribution,
        "rotation_sigma": ROTATION_SIGMA,
        "shift_sigma": SHIFT_SIGMA,
        "min_contact": MIN_CONTACT,
        "chunk_atoms": CHUNK_ATOMS,
    }
    writer = StoreWriter(
        out,
        num_atoms,
        units={"energy": "kcal/mol"},
        key=json.dumps(params, sort_keys=True),
        descriptions={
            "energy": "TIP3P interaction energy of rigid waters (sampled around relaxed templates)"
        },
        attrs={
            "source": "synthetic-tip3p",
            "source_version": "2",
            "synthetic": True,
            **{k: v for k, v in params.items() if k != "generator"},
        },
    )
    tasks, first = [], 0  # (waters, chunk, first molecule, count) still to write
    for waters, count in counts.items():
        per_chunk = max(1, CHUNK_ATOMS // (3 * waters))
        for chunk, lo in enumerate(range(0, count, per_chunk)):
            n = min(per_chunk, count - lo)
            if first + lo >= writer.written:
                tasks.append((seed, templates, waters, chunk, n, first + lo))
        first += count
    start = time.perf_counter()
    bar = tqdm(
        total=clusters,
        initial=writer.written,
        desc="generate water",
        unit="cluster",
        disable=not progress,
        file=sys.stderr,
        smoothing=0.05,
    )
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 0 else None
    try:
        chunks = pool.imap(_chunk_task, tasks) if pool else map(_chunk_task, tasks)
        for (_, _, waters, _, n, begin), (pos, energy) in zip(tasks, chunks):
            z = np.tile(np.array([8, 1, 1], dtype=np.uint8), n * waters)
            writer.append(z, pos, {"energy": energy}, np.arange(begin, begin + n))
            bar.set_postfix_str(f"W{waters}")
            bar.update(n)
    except BaseException:
        writer.close()  # the partial file stays for resuming
        raise
    finally:
        bar.close()
        if pool:
            pool.terminate()
    seconds = time.perf_counter() - start
    log.info("generated %d water clusters in %.1f s", clusters, seconds)
    return writer.finish({"generation_seconds": seconds})


_TEMPLATES: dict[tuple[int, int, int], Templates] = {}  # per process: (seed, waters, count)


def _chunk_task(task: tuple[int, int, int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """One chunk, in a worker or in-process: (pos float32 [n, 3w, 3], energy [n])."""
    seed, count, waters, chunk, n, _ = task
    key = (seed, waters, count)
    if key not in _TEMPLATES:
        _TEMPLATES.clear()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small batched ops: one thread is faster and repeatable
        try:
            _TEMPLATES[key] = Templates(seed, waters, count)
        finally:
            torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sample_chunk(_TEMPLATES[key], seed, waters, chunk, n)
    finally:
        torch.set_num_threads(threads)
