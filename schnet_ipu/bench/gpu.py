"""Full QM9 training epochs on one GPU: ours (each precision, with and without a CUDA graph
per step) against stock PyG SchNet on PyG's DataLoader, side by side in one process.

    python -m schnet_ipu.bench gpu --json docs/benchmarks/gpu-h100.json
    python -m schnet_ipu.bench gpu --device cpu --subset 300 --quick   # a smoke run on a CPU

Every variant trains the paper model (configs/qm9.yaml: 100 features, 4 interactions,
25 Gaussians, cutoff 6 A, Adam 1e-3) on the same training split. Round 0 is an untimed
warm-up epoch of every variant (graph capture, cuBLAS set-up, caches); then each round
times one full epoch of each variant in turn, so a change in the machine's load hits every
variant alike. Medians over the rounds.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from schnet_ipu import components
from schnet_ipu.backends import ReplicaInfo
from schnet_ipu.bench.common import QM9_STORE, new_report, packs_for, ratio
from schnet_ipu.bench.throughput import PYG, RADIUS_BUILDER, pyg, pyg_items
from schnet_ipu.config import Config, apply_override, config_from_dict, load_config, validate
from schnet_ipu.loader import PackedLoader
from schnet_ipu.pipeline import PreparedData, make_loader, prepare_data
from schnet_ipu.task import evaluate, make_task

PAPER_CONFIG = Path(__file__).resolve().parents[2] / "configs/qm9.yaml"
PRECISIONS = ("fp32", "tf32", "bf16")

COLUMNS = ["name", "epoch_seconds", "molecules_per_s", "molecules_per_step", "steps_per_epoch",
           "peak_memory_mb", "ratio_vs_pyg", "data_fraction", "graph_recaptures",
           "recompilations", "val_mae"]  # fmt: skip
PLOT = ("name", "epoch_seconds", "seconds per QM9 training epoch")

Epoch = Callable[[int], dict]  # round -> {"molecules", "steps", and optional extras}


def paper_config(store: str | Path, device: str, subset: int, overrides: list[str]) -> Config:
    """configs/qm9.yaml on ``store``; ``subset`` > 0: that many molecules, 10% val and test."""
    base = [f"data.path={store}", f"backend.device={device}", "logging.progress=false"]
    if subset:
        base += [f"data.subset={subset}", "data.val=0.1", "data.test=0.1"]
    return load_config(PAPER_CONFIG, [*base, *overrides])


def variant_config(cfg: Config, precision: str, graphs: bool) -> Config:
    """A copy of ``cfg`` with this variant's precision and CUDA-graph setting."""
    copy = config_from_dict(cfg.to_dict())
    apply_override(copy, f"backend.precision={precision}")
    apply_override(copy, f"backend.cuda_graphs={'true' if graphs else 'false'}")
    validate(copy)
    return copy


def ours(
    cfg: Config, data: PreparedData, loader: PackedLoader, device: str
) -> tuple[Epoch, object]:
    """Our trainer (model, fused Adam, backend) and an epoch function over ``loader`` (the
    same batches for every variant); the step losses stay on the device until the epoch's
    end."""
    backend = components.make_trainer(cfg, data, ReplicaInfo(), device)[2]

    def epoch(round_: int) -> dict:
        losses, molecules, steps = [], 0, 0
        data_seconds = 0.0
        calls = iter(loader.epoch(round_))
        while True:
            tick = time.perf_counter()
            call = next(calls, None)
            data_seconds += time.perf_counter() - tick
            if call is None:
                break
            for record in backend.train_call(call):
                losses.append(record["loss"])
                molecules += record["molecules"]
                steps += 1
        loss = float(torch.stack(losses).mean())  # the epoch's one synchronisation
        return {"molecules": molecules, "steps": steps, "data_seconds": data_seconds, "loss": loss}

    return epoch, backend


def stock_pyg(data: PreparedData, cfg: Config, batch_size: int, device: str, items: list) -> Epoch:
    """Stock PyG SchNet (the throughput suite's) for one epoch of ``batch_size`` batches."""
    step = pyg(data, cfg.model, batch_size, device, items)
    steps = math.ceil(len(items) / batch_size)

    def epoch(round_: int) -> dict:
        return {"molecules": sum(step() for _ in range(steps)), "steps": steps}

    return epoch


def time_rounds(epochs: dict[str, Epoch], rounds: int, device: str) -> dict[str, dict]:
    """An untimed warm-up epoch of each variant, then ``rounds`` rounds of one timed epoch of
    each in turn; per variant the median epoch seconds, its counts and peak memory."""
    cuda = device.startswith("cuda")
    seconds: dict[str, list[float]] = {name: [] for name in epochs}
    last: dict[str, dict] = {}
    peak: dict[str, int] = dict.fromkeys(epochs, 0)
    for round_ in range(rounds + 1):
        for name, epoch in epochs.items():
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            counts = epoch(round_)
            if cuda:
                torch.cuda.synchronize(device)
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device))
            took = time.perf_counter() - start
            print(f"round {round_} {name}: {took:.2f} s", file=sys.stderr, flush=True)
            if round_:
                seconds[name].append(took)
                last[name] = counts
    results = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        counts = last[name]
        results[name] = {
            "epoch_seconds": median,
            "epoch_seconds_all": times,
            "molecules_per_s": counts["molecules"] / median,
            "molecules_per_step": counts["molecules"] / counts["steps"],
            "steps_per_epoch": counts["steps"],
            "peak_memory_mb": peak[name] / 2**20 if cuda else None,
            "data_fraction": counts["data_seconds"] / median if "data_seconds" in counts else None,
            "train_loss_last_epoch": counts.get("loss"),
        }
    return results


def run_gpu(
    store: str | Path = QM9_STORE,
    device: str = "cuda",
    subset: int = 0,
    rounds: int = 3,
    pyg_batches: tuple[int, ...] = (32, 128, 512),
    precisions: tuple[str, ...] = PRECISIONS,
    overrides: list[str] = (),
    molecules_per_step: int = 32,
) -> dict:
    """Every variant side by side; ``ratio_vs_pyg`` of our fastest epoch over PyG's fastest.

    CUDA-graph variants need a CUDA ``device`` (on a CPU only the eager ones run). Ours trains
    about ``molecules_per_step`` molecules per optimiser step (whole packs); PyG runs batches
    of each size in ``pyg_batches``.
    """
    cfg = paper_config(store, device, subset, list(overrides))
    data = prepare_data(cfg)
    cfg.packing.packs_per_batch = packs_for(data, molecules_per_step)
    loader = make_loader(cfg, data, "train", pin_memory=device.startswith("cuda"), device=device)
    graph_choices = (False, True) if device.startswith("cuda") else (False,)
    epochs: dict[str, Epoch] = {}
    backends: dict[str, object] = {}
    configs: dict[str, Config] = {}
    for precision in precisions:
        for graphs in graph_choices:
            name = f"ours {precision}" + (" cuda graph" if graphs else " eager")
            configs[name] = variant_config(cfg, precision, graphs)
            epochs[name], backends[name] = ours(configs[name], data, loader, device)
    items = pyg_items(data)
    for batch_size in pyg_batches:
        epochs[f"{PYG} batch {batch_size}"] = stock_pyg(data, cfg, batch_size, device, items)
    measured = time_rounds(epochs, rounds, device)

    rows = []
    for name, row in measured.items():
        row = {"name": name, **row}
        if name in backends:
            backend = backends[name]
            val_loader = make_loader(configs[name], data, "val")
            val = evaluate(make_task(configs[name], data), backend, val_loader, "val")
            row.update(
                precision=configs[name].backend.precision,
                cuda_graph=configs[name].backend.cuda_graphs == "true",
                graph_recaptures=max(backend.graph_captures - 1, 0),
                recompilations=backend.recompilations,
                val_mae=val["mae"],
            )
        rows.append(row)
    seconds = {row["name"]: row["epoch_seconds"] for row in rows}
    best_ours = min((n for n in seconds if n.startswith("ours")), key=seconds.get)
    best_pyg = min((n for n in seconds if n.startswith(PYG)), key=seconds.get)
    for row in rows:
        row["ratio_vs_pyg"] = ratio(seconds[best_pyg], row["epoch_seconds"])
    ratios = {
        "best_ours": best_ours,
        "best_pyg": best_pyg,
        "ratio_vs_pyg": ratio(seconds[best_pyg], seconds[best_ours]),
        "ratio_vs_pyg_batch_32": ratio(
            seconds.get(f"{PYG} batch 32", math.nan), seconds[best_ours]
        ),
    }
    on = torch.device(device)
    feed_device = str(loader.dataset.arrays.device)
    report = new_report("gpu", rows, ratios, notes(cfg, data, rounds, device, subset, feed_device))
    report["device"] = {
        "name": torch.cuda.get_device_name(on) if on.type == "cuda" else "cpu (not a GPU run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if on.type == "cuda" else None,
    }
    return report


def notes(
    cfg: Config, data: PreparedData, rounds: int, device: str, subset: int, feed_device: str
) -> list[str]:
    plan = data.train_plan
    lines = [
        f"{len(data.split['train'])} QM9 training molecules"
        + (f" (a {subset}-molecule subset: NOT a full-epoch figure)" if subset else "")
        + f", target {cfg.data.target}; SchNet {cfg.model.hidden_channels} features, "
        f"{cfg.model.num_interactions} interactions, {cfg.model.num_gaussians} Gaussians, "
        f"cutoff {cfg.model.cutoff}; Adam lr {cfg.optim.lr}, constant during the benchmark.",
        f"Ours: {cfg.packing.packs_per_batch} packs of {plan.max_nodes} atoms / "
        f"{plan.max_edges} edges / {plan.max_graphs} molecules per step (tuple packing, "
        f"radius graph, pair-symmetric filters), {cfg.loader.workers} loader worker(s), "
        f"batches assembled on {feed_device} (loader.device_resident="
        f"{cfg.loader.device_resident}; from a CPU feed to CUDA: pinned, non-blocking "
        "copies); the step losses are read once per epoch.",
        f"Stock PyG: torch_geometric.nn.models.SchNet with its DataLoader (shuffle) on the "
        f"same molecules and loss, torch's default Adam; radius graph: {RADIUS_BUILDER}.",
        f"Timing: an untimed warm-up epoch of every variant, then {rounds} round(s) of one "
        "epoch of each variant in turn; medians. data_fraction: share of our epoch spent "
        "waiting for the loader. val_mae: validation MAE (eV) after the warm-up and timed "
        "epochs (the same number for every variant of ours).",
        "graph_recaptures: CUDA-graph captures after the first (the shape guard makes a "
        "re-capture impossible: a changed shape raises instead).",
    ]
    if not device.startswith("cuda"):
        lines.append(f"Run on {device}: CUDA-graph variants skipped; no GPU memory figures.")
    return lines


def run(quick: bool, store: str, device: str = "cuda", subset: int = 0,
        overrides: list[str] = (), molecules_per_step: int = 32) -> dict:  # fmt: skip
    options = {"overrides": overrides, "molecules_per_step": molecules_per_step}
    sizes = {32, 128, molecules_per_step} if quick else {32, 128, 512, molecules_per_step}
    pyg_batches = tuple(sorted(sizes))  # PyG at our step size too
    return run_gpu(store, device, subset, rounds=1 if quick else 3, pyg_batches=pyg_batches,
                   **options)  # fmt: skip
