"""MACE (mace-torch 0.3.16) trained on energies and forces for M minutes: a peer of
``python -m schnet_ipu.bench forces --peer mace``; only this module imports mace, in a child.

Built as mace's ``mace_run_train`` builds it, through its own functions (read from the
installed package): the arguments are mace's parser (``mace/tools/arg_parser.py``,
``build_default_arg_parser``, checked by ``mace/tools/arg_parser_tools.py`` ``check_args``)
given :data:`FLAGS`, so every setting not named there is mace's default; the model is
``configure_model`` (``mace/tools/model_script_utils.py``: ``--model MACE`` builds a
``ScaleShiftMACE`` with shift 0 and the RMS of the training forces as scale,
``rms_forces_scaling``); E0s by least squares on the training frames
(``mace/data/utils.py`` ``compute_average_E0s``, ``--E0s average``); the average neighbour
count ``mace/modules/utils.py`` ``compute_avg_num_neighbors``; the loss, optimizer and
scheduler ``get_loss_fn`` (``WeightedEnergyForcesLoss``: per-atom energy MSE + 100 x force
MSE, ``mace/modules/loss.py``), ``get_params_options`` / ``get_optimizer`` (Adam with
AMSGrad, lr 1e-2, weight decay 5e-7 on the interaction and product weights) and
``LRScheduler`` (``ReduceLROnPlateau``, factor 0.8, patience 50 epochs) from
``mace/tools/scripts_utils.py``; the step as ``mace/tools/train.py`` ``take_step`` takes it
(gradient norm clipped at 10, then an EMA update, decay 0.99, ``torch_ema``), validation
each epoch with the EMA weights (``evaluate``, eval_interval 1) and the best-validation-loss
EMA weights kept, as its checkpoint handler keeps them (``train``). Batch size 10: the
``--batch_size`` default and the README's training example. Data as ``mace/cli/run_train.py``
builds it: ``Configuration`` -> ``AtomicData.from_config`` (matscipy neighbour list, r_max
5 A), mace's ``torch_geometric`` loader (shuffled, drop_last, seeded by ``--seed`` 123), the
element table from the training and validation frames.

Left out: Stage Two (``--stage_two``: a last phase from a chosen epoch, which a wall-clock
budget has no epoch count for) and the pre-training validation pass. The clock counts
training steps and the per-epoch validations; building the graphs does not count (as our
data preparation does not); when the budget ends mid-epoch the final weights are validated
outside it, as the schnetpack side does."""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import mace
import numpy as np
import torch
from mace import data as mace_data
from mace import modules, tools
from mace.tools import torch_geometric
from mace.tools.model_script_utils import configure_model
from mace.tools.scripts_utils import (
    LRScheduler,
    dict_to_array,
    get_loss_fn,
    get_optimizer,
    get_params_options,
)
from mace.tools.train import evaluate
from torch_ema import ExponentialMovingAverage

HEADS = ["Default"]
# the small MACE; every other setting is mace's default
FLAGS = ["--model=MACE", "--num_interactions=2", "--correlation=3", "--num_channels=64",
         "--max_L=0", "--r_max=5.0", "--E0s=average", "--loss=weighted", "--energy_weight=1.0",
         "--forces_weight=100.0", "--optimizer=adam", "--amsgrad", "--lr=0.01", "--ema",
         "--ema_decay=0.99", "--default_dtype=float32", "--batch_size=10",
         "--valid_batch_size=10", "--device=cpu"]  # fmt: skip
OUTPUTS = {"forces": True, "virials": False, "stress": False}


def mace_args(work_dir: Path) -> argparse.Namespace:
    """mace's training arguments for :data:`FLAGS`, as ``run_train`` completes them."""
    given = tools.build_default_arg_parser().parse_args(
        ["--name=bench", f"--work_dir={work_dir}", *FLAGS]
    )
    args, _ = tools.check_args(given)
    args.compute_energy, args.compute_dipole, args.compute_polarizability = True, False, False
    return args


def configurations(frames: dict, index: np.ndarray) -> list:
    """The frames (:func:`.forces.store_frames`) at ``index`` as mace ``Configuration``s."""
    return [
        mace_data.Configuration(
            atomic_numbers=np.asarray(frames["z"][i]), positions=np.asarray(frames["pos"][i]),
            properties={"energy": frames["energy"][i], "forces": np.asarray(frames["forces"][i])},
            property_weights={"energy": 1.0, "forces": 1.0},
            cell=np.asarray(frames["cell"][i], dtype=float),
            pbc=tuple(bool(p) for p in frames["pbc"][i]),
        )
        for i in index
    ]  # fmt: skip


def errors(model, loss_fn, loader) -> dict[str, float]:
    """mace's ``evaluate`` on ``loader``: energy MAE (eV, eV/atom), force MAE and its loss."""
    loss, aux = evaluate(model, loss_fn, loader, OUTPUTS, torch.device("cpu"))
    return {"mae": float(aux["mae_e"]), "energy_mae_per_atom": float(aux["mae_e_per_atom"]),
            "force_mae": float(aux["mae_f"]), "loss": float(loss)}  # fmt: skip


def train_mace(frames: dict, split: dict[str, np.ndarray], minutes: float, work_dir: Path) -> dict:
    """Train for ``minutes`` by the module docstring's recipe (in a child): a row with its curve."""
    torch.set_num_threads(1)
    os.makedirs(work_dir, exist_ok=True)
    args = mace_args(work_dir)
    tools.set_seeds(args.seed)
    tools.set_default_dtype(args.default_dtype)
    sets = {name: configurations(frames, split[name]) for name in ("train", "val", "test")}
    z_table = tools.get_atomic_number_table_from_zs(
        z for name in ("train", "val") for config in sets[name] for z in config.atomic_numbers
    )
    graphs = {
        name: [mace_data.AtomicData.from_config(c, z_table=z_table, cutoff=args.r_max, heads=HEADS)
               for c in configs]
        for name, configs in sets.items()
    }  # fmt: skip
    train_loader = torch_geometric.dataloader.DataLoader(
        graphs["train"], batch_size=args.batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )  # fmt: skip
    loaders = {
        name: torch_geometric.dataloader.DataLoader(graphs[name], batch_size=args.valid_batch_size)
        for name in ("val", "test")
    }
    e0s = {HEADS[0]: mace_data.compute_average_E0s(sets["train"], z_table)}
    args.avg_num_neighbors = modules.compute_avg_num_neighbors(train_loader)
    model, _ = configure_model(args, train_loader, dict_to_array(e0s, HEADS), heads=HEADS,
                               z_table=z_table)  # fmt: skip
    loss_fn = get_loss_fn(args, False, False)
    optimizer = get_optimizer(args, get_params_options(args, model))
    scheduler = LRScheduler(optimizer, args)
    ema = ExponentialMovingAverage(model.parameters(), decay=args.ema_decay)

    budget, start = 60.0 * minutes, time.perf_counter()
    curve: list[tuple[float, float, float]] = []  # (s, validation force MAE, energy MAE)
    best_loss, best_state, valid_loss = float("inf"), None, float("inf")
    seen, train_seconds, seconds, epoch = 0, 0.0, 0.0, 0  # seconds: the budget's count
    while seconds < budget:
        if epoch > 0:
            scheduler.step(metrics=valid_loss)
        last = time.perf_counter()
        for batch in train_loader:
            optimizer.zero_grad(set_to_none=True)
            output = model(batch.to_dict(), training=True, compute_force=True,
                           compute_virials=False, compute_stress=False)  # fmt: skip
            loss_fn(pred=output, ref=batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=args.clip_grad)
            optimizer.step()
            ema.update()
            now = time.perf_counter()
            train_seconds, last, seen = train_seconds + now - last, now, seen + batch.num_graphs
            seconds = now - start
            if seconds >= budget:
                break
        with ema.average_parameters():  # validated and kept (when best) as mace's EMA weights
            result = errors(model, loss_fn, loaders["val"])
            if result["loss"] < best_loss:
                best_loss, best_state = result["loss"], copy.deepcopy(model.state_dict())
        valid_loss = result["loss"]
        curve.append((time.perf_counter() - start, result["force_mae"], result["mae"]))
        if seconds < budget:  # a whole epoch's validation counts; one after the budget does not
            seconds = time.perf_counter() - start
        epoch += 1
    model.load_state_dict(best_state)
    test = errors(model, loss_fn, loaders["test"])
    recipe = (f"{args.hidden_irreps}, {args.num_interactions} layers, correlation "
              f"{args.correlation}, max_ell {args.max_ell}, r_max {args.r_max}, E0s fitted, "
              f"batch {args.batch_size}, AMSGrad {args.lr}, loss weights "
              f"{args.energy_weight}:{args.forces_weight}, EMA {args.ema_decay}, "
              f"{args.default_dtype}")  # fmt: skip
    return {"name": f"MACE {mace.__version__}", **{f"test_{k}": v for k, v in test.items()},
            "structures_per_s": seen / max(train_seconds, 1e-9), "structures_seen": seen,
            "epochs": seen / len(graphs["train"]), "seconds": seconds,
            "curve": curve, "recipe": recipe,
            "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
