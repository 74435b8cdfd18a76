"""Accuracy at equal wall time: our trainer and stock PyG SchNet, M minutes each.

    python -m schnet_ipu.bench accuracy --minutes 10 [--ours-only] [--json out.json] [--out-dir DIR]

One after the other, on the same split and model size (``configs/qm9.yaml``): ours with
``optim.max_minutes=M``; stock PyG SchNet with batches of 32, Adam 1e-3 on a cosine over the
M minutes, validated 20 times, its best-validation weights tested. ``--ours-only`` skips the
PyG side (long budgets, where its ratio is known from the shorter ones).
``accuracy_vs_time.png`` draws the validation curves.
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from pathlib import Path

import torch

from schnet_ipu.bench import common, pyg
from schnet_ipu.config import load_config
from schnet_ipu.pipeline import PreparedData, prepare_data

COLUMNS = ["name", "test_mae", "best_val_mae", "molecules_seen", "epochs", "seconds"]
PLOT = ("name", "test_mae", "test MAE after equal wall time (eV)")
QUICK = {"minutes": 1.0, "subset": 4000}


def stock_pyg(data: PreparedData, model_cfg, minutes: float) -> dict:
    """Stock PyG SchNet for ``minutes`` (see the module docstring)."""
    from torch_geometric.loader import DataLoader

    train_items, val_items = pyg.items(data, "train"), pyg.items(data, "val")
    train_index = data.split["train"]
    per_atom = data.targets[train_index] / data.store.num_atoms[train_index]
    torch.manual_seed(0)
    model = pyg.schnet(model_cfg, mean=float(per_atom.mean()), std=float(per_atom.std()))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(train_items, batch_size=32, shuffle=True)
    budget, every = 60.0 * minutes, 3.0 * minutes
    curve, best, best_state = [], math.inf, copy.deepcopy(model.state_dict())
    seen, start, next_val = 0, time.perf_counter(), every
    while time.perf_counter() - start < budget:
        for batch in loader:
            elapsed = time.perf_counter() - start
            if elapsed >= budget:
                break
            for group in optimizer.param_groups:  # cosine over the wall-clock budget
                group["lr"] = 1e-3 * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
            loss = (model(batch.z, batch.pos, batch.batch) - batch.y.view(-1, 1)).square().mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += batch.num_graphs
            if time.perf_counter() - start >= next_val:
                next_val += every
                mae = pyg.mae(model, val_items)
                curve.append((time.perf_counter() - start, mae))
                if mae < best:
                    best, best_state = mae, copy.deepcopy(model.state_dict())
    mae = pyg.mae(model, val_items)
    curve.append((time.perf_counter() - start, mae))
    if mae < best:
        best, best_state = mae, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    return {
        "name": "stock PyG SchNet",
        "test_mae": pyg.mae(model, pyg.items(data, "test")),
        "best_val_mae": best,
        "molecules_seen": seen,
        "epochs": seen / len(train_items),
        "seconds": budget,
        "curve": curve,
    }


def ours(cfg_overrides: list[str], minutes: float, run_dir: Path) -> dict:
    final, epochs = common.train_for(
        load_config(common.PAPER_CONFIG, cfg_overrides), minutes, run_dir
    )
    return {
        "name": "ours (configs/qm9.yaml)",
        "test_mae": final["test_mae"],
        "best_val_mae": final["best_val_mae"],
        "molecules_seen": sum(r["molecules_per_s"] * r["epoch_seconds"] for r in epochs),
        "epochs": sum(r["epoch_fraction"] for r in epochs),
        "seconds": final["budget_seconds"],
        "curve": [(r["budget_seconds"], r["val_mae"]) for r in epochs],
    }


def run(
    store: str | Path,
    minutes: float = 10.0,
    subset: int = 0,
    out_dir: str | Path = "bench_results",
    overrides: tuple[str, ...] = (),
    ours_only: bool = False,
) -> dict:
    """Both sides (``ours_only``: ours alone) on ``configs/qm9.yaml``'s data and model with
    ``overrides`` applied."""
    shared = [f"data.path={store}", f"data.subset={subset}", *overrides]
    with tempfile.TemporaryDirectory() as folder:
        rows = [ours(shared, minutes, Path(folder) / "run")]
        if not ours_only:
            cfg = load_config(common.PAPER_CONFIG, shared)
            rows.append(stock_pyg(prepare_data(cfg), cfg.model, minutes))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common.curve_plot(rows, ["validation MAE (eV)"], out / "accuracy_vs_time.png")
    ratios = {}
    if not ours_only:
        ratios["test_mae_ours_over_pyg"] = common.ratio(rows[0]["test_mae"], rows[1]["test_mae"])
    sides = "ours alone" if ours_only else "each, one after the other"
    notes = [
        f"{minutes} min {sides}; threads {torch.get_num_threads()}",
        "curves: validation MAE against seconds of training (ours: the budget's count)",
        f"accuracy_vs_time.png in {out}",
    ]
    return common.new_report("accuracy", rows, ratios, notes)
