"""Full QM9 training epochs on one GPU: ours (each precision, eager and a CUDA graph per step,
and the tf32 step ``VARIANTS``) against stock PyG SchNet, side by side in one process. The
committed reports (H100, H200): docs/benchmarks/gpu/; their figures: docs/benchmarks/README.md.
``--profile``: the top kernels per step; ``--device cpu --subset 300 --quick``: a CPU smoke run."""

from __future__ import annotations

import functools
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from schnet_ipu.backends import ReplicaInfo
from schnet_ipu.bench import common, pyg
from schnet_ipu.config import Config, load_config
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.training import setup as components
from schnet_ipu.training.data import PreparedData, make_loader, prepare_data
from schnet_ipu.training.evaluation import evaluate

PRECISIONS = ("fp32", "tf32", "bf16")
VARIANT_PRECISION = "tf32"
VARIANTS = {"compiled": ["backend.compile=true"], "fused": ["model.ops=triton"],
            "table": ["model.ops=triton", "model.filter=table"],
            "compiled fused": ["backend.compile=true", "model.ops=triton"],
            "compiled fused table": ["backend.compile=true", "model.ops=triton",
                                     "model.filter=table"],
            "compiled table": ["backend.compile=true", "model.filter=table"]}  # fmt: skip
CUDA_ONLY = tuple(n for n, extra in VARIANTS.items() if "model.ops=triton" in extra)  # Triton: CUDA
QUICK = {"rounds": 1, "pyg_batches": (32, 128)}
PROFILE_STEPS = 20
PROFILE_ROWS = 15
COLUMNS = ["name", "epoch_seconds", "molecules_per_s", "molecules_per_step", "steps_per_epoch",
           "peak_memory_mb", "ratio_vs_pyg_best", "data_fraction", "graph_recaptures",
           "recompilations", "compiled_graphs_after_warmup", "val_mae"]  # fmt: skip
PLOT = ("name", "epoch_seconds", "seconds per QM9 training epoch")

Epoch = Callable[[], dict]  # the next epoch (the first: the warm-up) -> its counts


def paper_config(store: str | Path, device: str, subset: int, overrides: list[str]) -> Config:
    """configs/qm9.yaml on ``store`` in one process (``subset`` > 0: that many molecules)."""
    base = [f"data.path={store}", f"backend.device={device}", "logging.progress=false",
            "model.filter=exact", "backend.compile=false", "backend.replicas=1",
            "optim.max_minutes=0", "optim.ema_decay=0"]  # fmt: skip
    if subset:
        base += [f"data.subset={subset}", "data.val=0.1", "data.test=0.1"]
    return load_config(common.PAPER_CONFIG, [*base, *overrides])


def ours(cfg: Config, data: PreparedData, loader: PackedLoader, device: str) -> tuple[Epoch, Any]:
    """Our trainer and its epochs over ``loader``; the losses stay on the device until the end."""
    backend = components.make_trainer(cfg, data, ReplicaInfo(), device)[2]
    rounds, warm = itertools.count(), {}  # warm: dynamo graphs compiled by the warm-up's end

    def epoch() -> dict:
        losses, molecules, data_seconds = [], 0, 0.0
        calls = iter(loader.epoch(next(rounds)))
        while True:
            tick = time.perf_counter()
            call = next(calls, None)
            data_seconds += time.perf_counter() - tick
            if call is None:
                break
            for record in backend.train_call(call):
                losses.append(record["loss"])
                molecules += record["molecules"]
        warm.setdefault("graphs", backend.compiled_graphs)
        return {"molecules": molecules, "steps": len(losses), "data_seconds": data_seconds,
                "loss": float(torch.stack(losses).mean()),  # the epoch's one synchronisation
                "recompiles": backend.compiled_graphs - warm["graphs"]}  # fmt: skip

    return epoch, backend


def stock_pyg(data: PreparedData, cfg: Config, batch_size: int, device: str, items: list) -> Epoch:
    """Stock PyG SchNet (the throughput suite's) for one epoch of ``batch_size`` batches."""
    step = pyg.Trainer(data, cfg.model, batch_size, device, items).step
    steps = math.ceil(len(items) / batch_size)
    return lambda: {"molecules": sum(step() for _ in range(steps)), "steps": steps}


def time_rounds(epochs: dict[str, Epoch], rounds: int, device: str) -> list[dict]:
    """A warm-up epoch of each, then ``rounds`` rounds of one epoch of each (the common timer)."""
    cuda = device.startswith("cuda")
    last = {name: {"peak": 0} for name in epochs}  # each variant's last epoch

    def step(name: str) -> int:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        last[name] = {**epochs[name](), "peak": last[name]["peak"]}
        if cuda:  # the epoch's end, and the next one's start, once the GPU is done
            torch.cuda.synchronize(device)
            last[name]["peak"] = max(last[name]["peak"], torch.cuda.max_memory_allocated(device))
        print(f"{name}: an epoch done", file=sys.stderr, flush=True)
        return last[name]["molecules"]

    steps = {name: functools.partial(step, name) for name in epochs}
    rates = common.measure_side_by_side(steps, common.Timing(warmup=1, steps=1, repeats=rounds))
    rows = []
    for name, rate in rates.items():
        counts, median = last[name], rate.step_seconds
        rows.append({
            "name": name, "epoch_seconds": median, "epoch_seconds_all": rate.seconds,
            "molecules_per_s": counts["molecules"] / median,
            "molecules_per_step": counts["molecules"] / counts["steps"],
            "steps_per_epoch": counts["steps"],
            "peak_memory_mb": counts["peak"] / 2**20 if cuda else None,
            "data_fraction": counts["data_seconds"] / median if "data_seconds" in counts else None,
            "train_loss_last_epoch": counts.get("loss"),
            "compiled_graphs_after_warmup": counts.get("recompiles"),
        })  # fmt: skip
    return rows


def run(
    store: str | Path = common.QM9_STORE, device: str = "cuda", subset: int = 0, rounds: int = 3,
    pyg_batches: tuple[int, ...] = (32, 128, 512), precisions: tuple[str, ...] = PRECISIONS,
    overrides: list[str] = (), molecules_per_step: int = 32,
    variants: tuple[str, ...] = tuple(VARIANTS), profile: bool = False,
) -> dict:  # fmt: skip
    cuda = device.startswith("cuda")
    data = prepare_data(paper_config(store, device, subset, list(overrides)))
    packs = f"packing.packs_per_batch={common.packs_for(data, molecules_per_step)}"
    setups, skipped = {}, []  # name -> (precision, CUDA graphs, overrides)
    for precision, graphs in itertools.product(precisions, (False, True) if cuda else (False,)):
        setups[f"ours {precision} {'cuda graph' if graphs else 'eager'}"] = (precision, graphs, [])
    for variant in variants:
        name = f"ours {VARIANT_PRECISION} {variant}" + (" cuda graph" if cuda else "")
        if variant in CUDA_ONLY and not cuda:
            skipped.append(f"{name}: the Triton kernels need CUDA tensors")
        else:
            setups[name] = (VARIANT_PRECISION, cuda, VARIANTS[variant])
    cfg = paper_config(store, device, subset, [*overrides, packs])
    loader = make_loader(cfg, data, "train", pin_memory=cuda, device=device)
    first_call = next(iter(loader.epoch(0)))
    epochs, trained = {}, {}  # trained: name -> (config, backend) of each of ours
    for name, (precision, graphs, extra) in setups.items():
        setting = [packs, f"backend.precision={precision}", f"backend.cuda_graphs={graphs}".lower()]
        try:  # a variant that cannot be configured, built or take a step is reported, and skipped
            variant = paper_config(store, device, subset, [*overrides, *setting, *extra])
            epoch, backend = ours(variant, data, loader, device)
            backend.train_call(first_call)
        except Exception as error:  # e.g. a config without the tabulated filter
            skipped.append(f"{name}: {type(error).__name__}: {error}")
            continue
        epochs[name], trained[name] = epoch, (variant, backend)
    items = pyg.items(data)
    for batch_size in sorted({*pyg_batches, molecules_per_step}):
        epochs[f"{pyg.NAME} batch {batch_size}"] = stock_pyg(data, cfg, batch_size, device, items)
    rows = time_rounds(epochs, rounds, device)
    profiles = {n: profile_steps(b, loader, device) for n, (_, b) in trained.items() if profile}
    for row in rows:
        if row["name"] in trained:
            variant, backend = trained[row["name"]]
            val_loader = make_loader(variant, data, "val")
            val = evaluate(components.make_task(variant, data), backend, val_loader, "val")
            row.update(precision=variant.backend.precision,
                       cuda_graph=variant.backend.cuda_graphs == "true",
                       compile=variant.backend.compile, ops=variant.model.ops,
                       graph_recaptures=max(backend.graph_captures - 1, 0),
                       recompilations=backend.recompilations, val_mae=val["mae"])  # fmt: skip
    seconds = {row["name"]: row["epoch_seconds"] for row in rows}
    best_ours = min((n for n in seconds if n.startswith("ours")), key=seconds.get)
    best_pyg = min((n for n in seconds if n.startswith(pyg.NAME)), key=seconds.get)
    for row in rows:
        row["ratio_vs_pyg_best"] = common.ratio(seconds[best_pyg], row["epoch_seconds"])
    ratios = {"best_ours": best_ours, "best_pyg": best_pyg,
              "ratio_vs_pyg_best": common.ratio(seconds[best_pyg], seconds[best_ours]),
              "ratio_vs_pyg_batch_32": common.ratio(seconds.get(f"{pyg.NAME} batch 32", math.nan),
                                                    seconds[best_ours])}  # fmt: skip
    plan = data.train_plan
    subset_note = f" (a {subset}-molecule subset: NOT a full-epoch figure)" if subset else ""
    model = cfg.model
    notes = [
        f"{len(data.split['train'])} QM9 training molecules{subset_note}, target "
        f"{cfg.data.target}; SchNet {model.hidden_channels}/{model.num_interactions}/"
        f"{model.num_gaussians}, cutoff {model.cutoff}; Adam lr {cfg.optim.lr}, constant.",
        f"Ours: {cfg.packing.packs_per_batch} packs of {plan.max_nodes} atoms / {plan.max_edges} "
        f"edges / {plan.max_graphs} molecules per step, {cfg.loader.workers} loader worker(s), "
        f"batches assembled on {loader.dataset.arrays.device}; losses read once per epoch. PyG: "
        f"its DataLoader, same loss, radius graph {pyg.RADIUS_BUILDER}.",
        f"Timing: one step of each of ours (a variant whose first step fails is skipped), a "
        f"warm-up epoch, then {rounds} round(s) of one epoch of each; medians. "
        "data_fraction: share of the epoch waiting for the loader; val_mae after the timed "
        "epochs; compiled_graphs_after_warmup: dynamo graphs compiled later (0: none); "
        "graph_recaptures: CUDA-graph captures after the first.",
        *(f"Skipped {line}" for line in skipped),
    ]
    device_facts = {"name": torch.cuda.get_device_name(device) if cuda else "cpu (not a GPU run)",
                    "torch": torch.__version__, "cuda": torch.version.cuda,
                    "cudnn": torch.backends.cudnn.version() if cuda else None}  # fmt: skip
    extra = {"profiles": profiles} if profiles else {}
    return common.new_report("gpu", rows, ratios, notes, **extra, device=device_facts)


def profile_steps(backend, loader: PackedLoader, device: str) -> dict:
    """The top kernels (CUDA) or ops (CPU) by self time over ``PROFILE_STEPS`` warm steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = 0
    with profile(activities=activities) as prof:
        for call in loader.epoch(0):
            steps += len(backend.train_call(call))
            if steps >= PROFILE_STEPS:
                break
        if cuda:
            torch.cuda.synchronize(device)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_by, row_limit=PROFILE_ROWS)
    print(f"profile, {steps} steps:\n{table}", file=sys.stderr, flush=True)
    top = sorted(averages, key=lambda e: getattr(e, sort_by), reverse=True)[:PROFILE_ROWS]
    per_step = [{"name": e.key, "ms_per_step": getattr(e, sort_by) / 1e3 / steps,
                 "calls": e.count / steps} for e in top]  # fmt: skip
    return {"steps": steps, "table": table, "top_per_step": per_step}
