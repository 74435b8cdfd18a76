"""Accuracy at equal wall time: our trainer and stock PyG SchNet, M minutes each, one after the
other on ``configs/qm9.yaml``'s split and size: ours under ``optim.max_minutes``, stock PyG
(batch 32, Adam 1e-3 on a cosine over the minutes, the best of 20 validations tested);
``--ours-only`` skips PyG. ``--run-dir DIR`` keeps our run in DIR instead of a temporary folder,
and the same command again resumes it there (Ctrl-C saves first), so a budget of hours need not
run in one sitting; stock PyG's side always starts afresh. The committed reports:
docs/benchmarks/accuracy/; their figures: docs/benchmarks/README.md."""

from __future__ import annotations

import copy
import math
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from schnet_ipu.bench import common, pyg
from schnet_ipu.config import load_config
from schnet_ipu.errors import EXIT_INTERRUPTED
from schnet_ipu.training.data import PreparedData, prepare_data
from schnet_ipu.training.lock import hold_run_lock

COLUMNS = ["name", "test_mae", "best_val_mae", "molecules_seen", "epochs", "seconds"]
PLOT = ("name", "test_mae", "test MAE after equal wall time (eV)")
QUICK = {"minutes": 1.0, "subset": 4000}


def stock_pyg(data: PreparedData, model_cfg, minutes: float) -> dict:
    train_items, val_items = pyg.items(data, "train"), pyg.items(data, "val")
    per_atom = data.targets[data.split["train"]] / data.store.num_atoms[data.split["train"]]
    mean, std = float(per_atom.mean()), float(per_atom.std())
    stock = pyg.Trainer(data, model_cfg, 32, "cpu", train_items, scale=1.0, mean=mean, std=std)
    model = stock.model  # its loss: the plain MSE in eV^2
    budget, every = 60.0 * minutes, 3.0 * minutes
    curve, best = [], {"mae": math.inf, "state": copy.deepcopy(model.state_dict())}
    seen, start, next_val = 0, time.perf_counter(), every

    def validate() -> None:
        mae = pyg.mae(model, val_items)
        curve.append((time.perf_counter() - start, mae))
        if mae < best["mae"]:
            best.update(mae=mae, state=copy.deepcopy(model.state_dict()))

    while (elapsed := time.perf_counter() - start) < budget:
        for group in stock.optimizer.param_groups:  # cosine over the wall-clock budget
            group["lr"] = 1e-3 * 0.5 * (1 + math.cos(math.pi * elapsed / budget))
        seen += stock.step()
        if time.perf_counter() - start >= next_val:
            next_val += every
            validate()
    validate()
    model.load_state_dict(best["state"])
    return {"name": "stock PyG SchNet", "test_mae": pyg.mae(model, pyg.items(data, "test")),
            "best_val_mae": best["mae"], "molecules_seen": seen,
            "epochs": seen / len(train_items), "seconds": budget, "curve": curve}  # fmt: skip


def run(
    store: str | Path, minutes: float = 10.0, subset: int = 0,
    out_dir: str | Path = "bench_results", overrides: tuple[str, ...] = (), ours_only: bool = False,
    run_dir: str | Path | None = None,
) -> dict:  # fmt: skip
    """Both sides (``ours_only``: ours alone) on ``configs/qm9.yaml`` with ``overrides``;
    ours in ``run_dir`` (resumed when it holds this run) or else in a temporary folder."""
    shared = [f"data.path={store}", f"data.subset={subset}"]
    if subset:  # the config's 10,000 + 10,000 held out would leave a subset nothing to train
        shared += [f"data.val={subset // 10}", f"data.test={subset // 10}"]
    shared += overrides
    cfg = load_config(common.PAPER_CONFIG, shared)
    with ExitStack() as stack:
        if run_dir is None:
            folder, fresh = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "run", True
        else:
            folder, fresh = Path(run_dir), False
            stack.enter_context(hold_run_lock(folder))  # one writer, as train.py
        try:
            final, ours = common.train_for(cfg, minutes, folder, ["val_mae"], fresh)
        except SystemExit as stop:  # a Ctrl-C: the run saved, but in a folder about to go
            if stop.code == EXIT_INTERRUPTED and run_dir is None:
                print(
                    "the run's temporary folder goes with it; --run-dir keeps one to resume",
                    file=sys.stderr,
                )
            raise
        rows = [{"name": "ours (configs/qm9.yaml)", "test_mae": final["test_mae"],
                 "best_val_mae": final["best_val_mae"], "molecules_seen": ours["seen"],
                 **{key: ours[key] for key in ("epochs", "seconds", "curve")}}]  # fmt: skip
        if not ours_only:
            rows.append(stock_pyg(prepare_data(cfg), cfg.model, minutes))
    common.curve_plot(rows, ["validation MAE (eV)"], out_dir, "accuracy_vs_time.png")
    maes = [row["test_mae"] for row in rows]  # ours, then stock PyG's
    ratios = {} if ours_only else {"test_mae_ours_over_pyg": common.ratio(*maes)}
    sides = "ours alone" if ours_only else "each, one after the other"
    notes = [
        f"{minutes} min {sides}; threads {torch.get_num_threads()}",
        "curves: validation MAE against seconds of training (ours: the budget's count)",
        f"accuracy_vs_time.png in {Path(out_dir)}",
    ]
    return common.new_report("accuracy", rows, ratios, notes)
