"""One emulated IPU training step on fixed inputs, saved under one torch and compared under
another (run by ``scripts/check_torch201.sh``: torch 2.13 saves, torch 2.0.1 compares).

    python scripts/torch201_compare.py save REF.pt      # needs data/qm9.h5
    python scripts/torch201_compare.py compare REF.pt   # exit 1 if anything differs > 1e-5

For a radius and a knn graph: SchNet with the ipu op flavour (the trainer's own
``build`` path: config, ``make_optimizer``, the energy task's loss and ``make_backend`` with
``backend.device=ipu-model``, so the PopTorch op check runs too) on one packed batch of real
QM9 molecules. The saved file holds the batch, the initial weights and the results: the
forward pass, the loss, every gradient after the backward pass, and every weight after one
Adam step. ``compare`` loads the batch and weights, reruns the step and reports the largest
absolute difference of each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from schnet_ipu.backends import make_backend
from schnet_ipu.batch import Batch
from schnet_ipu.config import config_from_dict
from schnet_ipu.model import SchNet
from schnet_ipu.task import EnergyTask, TargetTransform
from schnet_ipu.training.setup import make_optimizer

TOLERANCE = 1e-5
STORE = "data/qm9.h5"
SCALE = 2.0  # loss scale (the standardised loss divides errors by it)


def config(graph: str):
    return config_from_dict(
        {
            "model": {
                "graph": graph,
                "k": 12,
                "hidden_channels": 32,
                "num_filters": 32,
                "ops": "ipu",
            },
            "optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 10.0},
            "packing": {"algorithm": "tuple" if graph == "radius" else "lpfhp"},
            "backend": {"device": "ipu-model"},
        }
    )


def packed_batch(graph: str) -> Batch:
    """Two packs of real QM9 molecules (torch 2.13 side only: the tests' batch helpers)."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from bench_helpers import load_molecules, molecules_to_batch, pair_array

    molecules = load_molecules(STORE, 12, seed=0)
    packs = [list(range(0, 6)), list(range(6, 12))]
    sizes = [len(z) for z, _ in molecules]
    max_nodes = max(sum(sizes[m] for m in pack) for pack in packs) + 3
    edges = None
    if graph == "radius":
        pairs = [len(pair_array(pos, 6.0)) for _, pos in molecules]
        edges = 2 * max(sum(pairs[m] for m in pack) for pack in packs) + 8
    targets = np.random.default_rng(0).normal(size=len(molecules))
    return molecules_to_batch(molecules, packs, max_nodes, 7, edges, 6.0, targets)


def run_step(graph: str, batch: Batch, weights: dict | None) -> dict:
    """Forward, loss, gradients and post-Adam-step weights of one emulated training step."""
    cfg = config(graph)
    torch.manual_seed(0)
    model = SchNet.from_config(cfg.model, max_nodes_per_pack=batch.num_nodes // 2)  # 2 packs
    if weights is not None:
        model.load_state_dict(weights)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        forward = model(batch)
    optimizer = make_optimizer(cfg, model, "cpu")
    loss_fn = EnergyTask(TargetTransform((0.0,) * 119, SCALE)).loss
    backend = make_backend(cfg.backend, model, optimizer, loss_fn, cfg.optim.grad_clip)
    (record,) = backend.train_call([batch])
    return {
        "initial": initial,
        "forward": forward,
        "loss": torch.tensor(record["loss"], dtype=torch.float64),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "stepped": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def largest_difference(a, b) -> float:
    if isinstance(a, dict):
        return max(largest_difference(a[k], b[k]) for k in a)
    return float((a.double() - b.double()).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["save", "compare"])
    parser.add_argument("path")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    if args.mode == "save":
        saved = {}
        for graph in ("radius", "knn"):
            batch = packed_batch(graph)
            result = run_step(graph, batch, None)
            fields = {k: v for k, v in vars(batch).items() if v is not None}
            saved[graph] = {"batch": fields, **result}
        torch.save(saved, args.path)
        print(f"saved {args.path}")
        return 0
    saved = torch.load(args.path)
    worst = 0.0
    for graph, ref in saved.items():
        batch = Batch(**ref["batch"])
        ours = run_step(graph, batch, ref["initial"])
        for key in ("forward", "loss", "grads", "stepped"):
            diff = largest_difference(ref[key], ours[key])
            worst = max(worst, diff)
            print(f"{graph:6s} {key:8s} max |torch {torch.__version__} - reference| = {diff:.3g}")
    verdict = "within" if worst <= TOLERANCE else "OUTSIDE"
    print(f"largest difference {worst:.3g}: {verdict} {TOLERANCE:g}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
