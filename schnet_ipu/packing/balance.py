"""Cost-model grouping of batches across data-parallel replicas.

Replicas step together (every optimiser step waits for the gradient reduction), so a step
lasts as long as its slowest replica's batch. With batches of different shapes (dynamic
batching), round-robin hands out a cheap and a costly batch to the same step often; grouping
puts batches of like cost in the same step instead:

* :func:`fit_cost_model`: step seconds ~ a * atoms + b * edges + c, least squares on measured
  steps, with its R^2;
* :func:`balance_batches`: sort the batches by predicted cost and cut the sorted list into
  steps of R (for fixed step size this minimises the sum over steps of the costliest batch
  of the step); inside a step the costliest batch goes to the replica with the least total
  so far, so replica totals stay even too. The steps are then shuffled (seeded) so training
  does not see the batches in size order. Every batch is used exactly once.
* :func:`round_robin`: the unbalanced reference, batch i to replica i mod R.

Schedules are int64 [steps, R] arrays of batch indices, -1 where a replica idles in the
epoch's last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Predicted step seconds ``atoms * per_atom + edges * per_edge + constant``."""

    per_atom: float
    per_edge: float
    constant: float
    r2: float  # on the steps it was fitted to

    def predict(self, atoms: np.ndarray, edges: np.ndarray) -> np.ndarray:
        """Seconds [n] for batches of ``atoms`` [n] and ``edges`` [n] (padded counts)."""
        atoms = np.asarray(atoms, dtype=np.float64)
        edges = np.asarray(edges, dtype=np.float64)
        return atoms * self.per_atom + edges * self.per_edge + self.constant


def r_squared(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Coefficient of determination of ``predicted`` against ``measured`` (both [n])."""
    measured = np.asarray(measured, dtype=np.float64)
    residual = np.square(measured - predicted).sum()
    total = np.square(measured - measured.mean()).sum()
    return float(1.0 - residual / total) if total > 0 else float("nan")


def fit_cost_model(atoms: np.ndarray, edges: np.ndarray, seconds: np.ndarray) -> CostModel:
    """Least-squares fit of ``seconds`` [n] on ``atoms`` [n], ``edges`` [n] and a constant."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if len(seconds) < 3:
        raise ValueError(f"a cost model needs at least 3 measured steps, got {len(seconds)}")
    design = np.stack([atoms, edges, np.ones(len(seconds))], axis=1).astype(np.float64)
    (per_atom, per_edge, constant), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    unscored = CostModel(float(per_atom), float(per_edge), float(constant), float("nan"))
    r2 = r_squared(unscored.predict(atoms, edges), seconds)
    return CostModel(unscored.per_atom, unscored.per_edge, unscored.constant, r2)


def round_robin(num_batches: int, replicas: int) -> np.ndarray:
    """Batch i to replica i mod R in step i // R -> int64 [steps, R], -1 for idle slots."""
    steps = -(-num_batches // replicas)
    schedule = np.full(steps * replicas, -1, dtype=np.int64)
    schedule[:num_batches] = np.arange(num_batches)
    return schedule.reshape(steps, replicas)


def balance_batches(costs: np.ndarray, replicas: int, seed: int = 0) -> np.ndarray:
    """Group batches of like predicted ``costs`` [n] into steps of R -> int64 [steps, R].

    Entry [s, r] is the batch replica r runs in step s (-1: idle, only in one step when R
    does not divide n). Each batch appears exactly once.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    order = np.argsort(-costs, kind="stable")
    steps = -(-len(costs) // replicas)
    schedule = np.full((steps, replicas), -1, dtype=np.int64)
    totals = np.zeros(replicas)
    for step in range(steps):
        group = order[step * replicas : (step + 1) * replicas]  # costliest first
        for batch, replica in zip(group, np.argsort(totals, kind="stable")):
            schedule[step, replica] = batch
            totals[replica] += costs[batch]
    return schedule[np.random.default_rng(seed).permutation(steps)]


def step_costs(schedule: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Cost [steps, R] of every slot of ``schedule`` (0 where idle)."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.where(schedule >= 0, costs[np.maximum(schedule, 0)], 0.0)


def loader_order(costs: np.ndarray, replicas: int, micro_per_call: int, seed: int) -> np.ndarray:
    """:func:`balance_batches` laid out in the loader's global micro-batch order.

    The loader gives replica r of call c its micro-batches ``(c * R + r) * micro_per_call + j``
    (j < micro_per_call), and the replicas step together on equal j. Returns int64 [positions]:
    the micro-batch (index into ``costs``) at each global position, -1 for an empty one.
    """
    schedule = balance_batches(costs, replicas, seed)  # [steps, R]
    calls = -(-len(schedule) // micro_per_call)
    padded = np.full((calls * micro_per_call, replicas), -1, dtype=np.int64)
    padded[: len(schedule)] = schedule
    return padded.reshape(calls, micro_per_call, replicas).transpose(0, 2, 1).reshape(-1)


# The loader's model: fitted by ``python -m schnet_ipu.bench balance --quick`` (QM9 row; 2 gloo
# replicas of 1 thread on the project's loaded 2-core CPU, SchNet 100 features x 4
# interactions, radius graph, eager). Only the ratios of the coefficients matter for grouping.
DEFAULT_COST = CostModel(per_atom=253e-6, per_edge=34.7e-6, constant=59.1e-3, r2=0.916)
