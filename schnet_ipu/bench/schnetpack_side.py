"""schnetpack 2.1.1's SchNet trained on energies and forces for M minutes: the peer of
``python -m schnet_ipu.bench forces``; only this module imports schnetpack, in a child.

Its stock MD17-style recipe, read from schnetpack v2.1.1 (``configs/experiment/md17.yaml``,
``tutorial_03_force_models.ipynb``, ``reduce_on_plateau.yaml``, ``default_trainer.yaml``):
batch 10, our frames, split and per-element atom references, MSE weighted 0.01/0.99, AdamW
5e-4, torch's ``ReduceLROnPlateau``, ``max_time`` M minutes on one thread, best-validation
weights tested. Errors as our trainer computes them."""

from __future__ import annotations

import copy
import os
import time
import typing
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
import torchmetrics
from ase import Atoms

# torch 2.13's one shim for schnetpack: its data/loader.py imports the gone dataloader.T_co
if not hasattr(torch.utils.data.dataloader, "T_co"):
    torch.utils.data.dataloader.T_co = typing.TypeVar("T_co", covariant=True)
import schnetpack as spk  # after the shim

BATCH_SIZE = 10
LEARNING_RATE = 5e-4
LOSS_WEIGHTS = {"energy": 0.01, "forces": 0.99}
# configs/task/scheduler/reduce_on_plateau.yaml, less schnetpack's smoothing_factor
PLATEAU = {"mode": "min", "factor": 0.5, "patience": 75, "threshold": 0.0,
           "threshold_mode": "rel", "cooldown": 10, "min_lr": 0.0}  # fmt: skip


def write_database(frames: dict, atomrefs: np.ndarray, path: Path) -> None:
    """The frames (:func:`.forces.store_frames`) as schnetpack's ASE db at ``path`` (eV, eV/A)."""
    dataset = spk.data.ASEAtomsData.create(
        str(path), distance_unit="Ang", property_unit_dict={"energy": "eV", "forces": "eV/Ang"},
        atomrefs={"energy": atomrefs[:100].tolist()},  # RemoveOffsets' table length (zmax)
    )  # fmt: skip
    columns = zip(frames["z"], frames["pos"], frames["cell"], frames["pbc"])
    atoms = [Atoms(numbers=z, positions=pos, cell=cell, pbc=pbc) for z, pos, cell, pbc in columns]
    properties = [{"energy": np.array([energy]), "forces": forces}
                  for energy, forces in zip(frames["energy"], frames["forces"])]  # fmt: skip
    dataset.add_systems(properties, atoms)


def build_task(model_cfg):
    """schnetpack's SchNet force field of our model's size, and its AtomisticTask."""
    features = model_cfg.hidden_channels
    schnet = spk.representation.SchNet(
        n_atom_basis=features, n_interactions=model_cfg.num_interactions,
        n_filters=model_cfg.num_filters,
        radial_basis=spk.nn.GaussianRBF(n_rbf=model_cfg.num_gaussians, cutoff=model_cfg.cutoff),
        cutoff_fn=spk.nn.CosineCutoff(model_cfg.cutoff),
    )  # fmt: skip
    model = spk.model.NeuralNetworkPotential(
        representation=schnet, input_modules=[spk.atomistic.PairwiseDistances()],
        output_modules=[
            spk.atomistic.Atomwise(n_in=features, output_key="energy", aggregation_mode="sum"),
            spk.atomistic.Forces(energy_key="energy", force_key="forces")],
        postprocessors=[
            spk.transform.CastTo64(),
            spk.transform.AddOffsets("energy", add_mean=True, add_atomrefs=True)],
    )  # fmt: skip
    outputs = [
        spk.task.ModelOutput(name=name, loss_fn=torch.nn.MSELoss(), loss_weight=weight,
                             metrics={"MAE": torchmetrics.MeanAbsoluteError()})
        for name, weight in LOSS_WEIGHTS.items()
    ]  # fmt: skip
    return spk.task.AtomisticTask(
        model=model, outputs=outputs, optimizer_cls=torch.optim.AdamW,
        optimizer_args={"lr": LEARNING_RATE},
        scheduler_cls=torch.optim.lr_scheduler.ReduceLROnPlateau,
        scheduler_args=dict(PLATEAU), scheduler_monitor="val_loss",
    )  # fmt: skip


def split_errors(task, loader) -> dict[str, float]:
    """Energy MAE (eV, eV/atom), force MAE and loss as ``test_step`` has them (targets copied)."""
    sums = dict.fromkeys(("mae", "energy_mae_per_atom", "force_mae", "loss"), 0.0)
    structures, components = 0, 0
    task.eval()
    for batch in loader:
        energy, forces = batch["energy"].clone(), batch["forces"].clone()
        atoms = batch[spk.properties.n_atoms].clone()
        pred = task.predict_without_postprocessing(batch)
        energy_error = (pred["energy"].detach() - energy).double()
        force_error = (pred["forces"].detach() - forces).double()
        sums["mae"] += float(energy_error.abs().sum())
        sums["energy_mae_per_atom"] += float((energy_error.abs() / atoms).sum())
        sums["force_mae"] += float(force_error.abs().sum())
        loss = LOSS_WEIGHTS["energy"] * energy_error.square().mean()
        loss += LOSS_WEIGHTS["forces"] * force_error.square().mean()
        sums["loss"] += float(loss) * len(energy)
        structures += len(energy)
        components += forces.numel()
    task.train()
    # means per structure, the force MAE per force component
    return {key: total / (components if key == "force_mae" else structures)
            for key, total in sums.items()}  # fmt: skip


def train_schnetpack(model_cfg, database: Path, split_file: Path, minutes: float) -> dict:
    """Train for ``minutes`` by the module docstring's recipe (in a child): a row with its curve."""
    os.chdir(database.parent)  # its data module locks splitting.lock in "."
    torch.set_num_threads(1)
    torch.manual_seed(0)
    transforms = [spk.transform.SubtractCenterOfMass(),
                  spk.transform.RemoveOffsets("energy", remove_mean=True, remove_atomrefs=True),
                  spk.transform.MatScipyNeighborList(cutoff=model_cfg.cutoff),
                  spk.transform.CastTo32()]  # fmt: skip
    data = spk.data.AtomsDataModule(str(database), batch_size=BATCH_SIZE,
                                    split_file=str(split_file), transforms=transforms,
                                    num_workers=0, pin_memory=False)  # fmt: skip
    data.prepare_data()
    data.setup()
    task = build_task(model_cfg)
    recorder = Recorder()
    trainer = pl.Trainer(max_time={"seconds": 60.0 * minutes}, max_epochs=100000,
                         accelerator="cpu", devices=1, num_sanity_val_steps=0,
                         inference_mode=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])  # fmt: skip
    trainer.fit(task, datamodule=data)
    # Lightning stops at max_time mid-epoch without validating: the final weights are
    # validated here (outside the budget) and kept if they are the best
    final = split_errors(task, data.val_dataloader())
    recorder.curve.append((recorder.seconds(), final["force_mae"], final["mae"]))
    if final["loss"] >= recorder.best_loss:
        task.load_state_dict(recorder.best_state)
    test = split_errors(task, data.test_dataloader())
    seen, weights = recorder.structures, f"{LOSS_WEIGHTS['energy']}/{LOSS_WEIGHTS['forces']}"
    recipe = (f"batch {BATCH_SIZE}, AdamW {LEARNING_RATE}, loss weights {weights}, "
              f"plateau (patience {PLATEAU['patience']} epochs)")  # fmt: skip
    return {"name": f"schnetpack {spk.__version__}", **{f"test_{k}": v for k, v in test.items()},
            "structures_per_s": seen / max(recorder.train_seconds, 1e-9), "structures_seen": seen,
            "epochs": seen / len(data.train_dataset), "seconds": recorder.seconds(),
            "curve": recorder.curve, "recipe": recipe}  # fmt: skip


class Recorder(pl.Callback):
    """Structures and seconds of training batches (loading in), validation curve, best weights."""

    def __init__(self) -> None:
        self.structures, self.train_seconds, self.best_loss = 0, 0.0, float("inf")
        self.curve: list[tuple[float, float, float]] = []  # (s, force MAE, energy MAE)
        self.best_state: dict | None = None
        self._start = self._last = 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def on_train_start(self, trainer, task) -> None:
        self._start = time.perf_counter()
        self.best_state = copy.deepcopy(task.state_dict())

    def on_train_epoch_start(self, trainer, task) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.train_seconds += now - self._last
        self._last = now
        self.structures += len(batch["_idx"])

    def on_validation_end(self, trainer, task) -> None:  # the epoch's metrics are in
        metrics = trainer.callback_metrics
        loss = float(metrics["val_loss"])
        forces, energy = float(metrics["val_forces_MAE"]), float(metrics["val_energy_MAE"])
        self.curve.append((self.seconds(), forces, energy))
        if loss < self.best_loss:
            self.best_loss, self.best_state = loss, copy.deepcopy(task.state_dict())
