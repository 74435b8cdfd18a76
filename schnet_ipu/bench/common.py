"""The suites' one harness: configs, the interleaved timer, machine facts and the report
(:func:`new_report`), which :func:`write_report` writes as JSON, markdown and PNG."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

from schnet_ipu.backends import cpu_multiplies_bf16, init_replica
from schnet_ipu.config import Config, ModelConfig, apply_override, validate
from schnet_ipu.data import MoleculeStore, generate_water, make_split
from schnet_ipu.feed.loader import PackedLoader
from schnet_ipu.model import SchNet
from schnet_ipu.training import setup as components
from schnet_ipu.training.data import PreparedData, make_loader, prepare_data

QM9_STORE = "data/qm9.h5"
ROOT = Path(__file__).resolve().parents[2]
PAPER_CONFIG = ROOT / "configs/qm9.yaml"
PAPER_SIZE = ModelConfig()  # the paper's SchNet: 100/100/4/25, cutoff 6 A, k = 24
FORCE_CONFIG = ROOT / "configs/emt_forces.yaml"


@dataclass
class Timing:
    """``warmup`` untimed calls, then ``repeats`` rounds of ``steps`` calls of each variant."""

    warmup: int = 3
    steps: int = 10
    repeats: int = 3


@dataclass
class Rate:
    """Medians over the rounds (``repeats``, ``seconds``: every round's rate and time per call)."""

    molecules_per_s: float
    step_seconds: float
    molecules_per_step: float
    repeats: list[float]
    seconds: list[float]


def measure_side_by_side(steps: dict[str, Callable[[], int]], timing: Timing) -> dict[str, Rate]:
    """The one timer: rounds of every step (it returns its item count) in turn; medians."""
    for step in steps.values():
        for _ in range(timing.warmup):
            step()
    windows: dict[str, list[tuple[float, int]]] = {name: [] for name in steps}
    for _ in range(timing.repeats):
        for name, step in steps.items():
            count = 0
            start = time.perf_counter()
            for _ in range(timing.steps):
                count += step()
            windows[name].append((time.perf_counter() - start, count))
    rates = {}
    for name, rounds in windows.items():
        per_s = [count / seconds for seconds, count in rounds]
        per_call = [seconds / timing.steps for seconds, _ in rounds]
        per_step = median(count / timing.steps for _, count in rounds)
        rates[name] = Rate(median(per_s), median(per_call), per_step, per_s, per_call)
    return rates


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def schnet(size: ModelConfig, **options: Any) -> SchNet:
    """Our SchNet of ``size`` (its first five hyperparameters) with ``options``."""
    return SchNet(size.hidden_channels, size.num_filters, size.num_interactions,
                  size.num_gaussians, size.cutoff, **options)  # fmt: skip


def fwd_bwd(
    model: torch.nn.Module, loss: Callable[[], torch.Tensor], count: int = 1, optimizer=None
) -> Callable[[], int]:
    """A timer step: ``loss()`` (the forward pass) and its backward (and ``optimizer``'s step)."""

    def step() -> int:
        model.zero_grad(set_to_none=True)
        loss().backward()
        if optimizer is not None:
            optimizer.step()
        return count

    return step


def our_trainer(
    store: str | Path, sample: int, size: ModelConfig, overrides: list[str],
    batch_molecules: float | None, replicas: int = 1,
) -> tuple[Config, PreparedData, PackedLoader, Any]:  # fmt: skip
    """Config, data, loader and backend of ``size`` on a fixed ``sample``, one of ``replicas``:
    about ``batch_molecules`` per step (None: ``packing.packs_per_batch`` as the overrides set
    it)."""
    cfg = Config(model=replace(size))  # the model under test; overrides pick its graph
    for item in [f"data.path={store}", f"data.subset={round(sample / 0.9)}", "data.val=0.05",
                 "data.test=0.05", "optim.grad_clip=0", "backend.device=cpu",
                 "logging.progress=false", *overrides, f"backend.replicas={replicas}"]:  # fmt: skip
        apply_override(cfg, item)
    validate(cfg)
    replica = init_replica(cfg.backend, "cpu")
    data = prepare_data(cfg)
    if batch_molecules is not None:
        cfg.packing.packs_per_batch = packs_for(data, batch_molecules / replicas)
    loader = make_loader(cfg, data, "train", replica.rank, replica.world_size)
    return cfg, data, loader, components.make_trainer(cfg, data, replica)[2]


@contextlib.contextmanager
def qm9_and_water(
    store: str | Path, sample: int, water_clusters: int, water_sizes: tuple[int, int]
) -> Iterator[dict[str, tuple[Path, np.ndarray]]]:
    """Name -> (store, indices): a fixed random ``sample`` of QM9, a temporary water store."""
    count = len(MoleculeStore(store))
    qm9_index = make_split(count, 0, 0, seed=0, subset=min(sample, count))["train"]
    with tempfile.TemporaryDirectory() as tmp:
        water = generate_water(Path(tmp) / "water.h5", water_clusters, water_sizes)
        yield {"qm9": (Path(store), qm9_index), "water": (water, np.arange(water_clusters))}


def packs_for(data: PreparedData, molecules_per_batch: float) -> int:
    """Packs per batch giving about ``molecules_per_batch`` molecules per step."""
    per_pack = len(data.split["train"]) / data.train_plan.num_packs
    return max(1, round(molecules_per_batch / per_pack))


def training_step(loader: PackedLoader, backend) -> Callable[[], int]:
    """A timer step: ``train_call`` on the loader's next host call (epoch after epoch)."""
    calls = itertools.chain.from_iterable(loader.epoch(e) for e in itertools.count())
    return lambda: sum(r["molecules"] for r in backend.train_call(next(calls)))


def train_for(
    cfg: Config, minutes: float, run_dir: Path, curve: list[str], fresh: bool = True
) -> tuple[dict, dict]:
    """``train.py``'s loop on ``cfg`` for ``minutes``: its final record and a row of its epochs
    (``fresh=False``: resuming a run of the same config that ``run_dir`` holds)."""
    from schnet_ipu.training.log import read_records
    from schnet_ipu.training.loop import train

    cfg = copy.deepcopy(cfg)
    for item in (f"optim.max_minutes={minutes}", "optim.epochs=100000", "logging.progress=false",
                 "logging.plot=false", f"logging.run_dir={run_dir}"):  # fmt: skip
        apply_override(cfg, item)
    validate(cfg)
    final = train(cfg, fresh=fresh)
    epochs = read_records(Path(run_dir) / "metrics.jsonl", "epoch")
    seen = sum(r["molecules_per_s"] * r["epoch_seconds"] for r in epochs)
    points = [(r["budget_seconds"], *(r[key] for key in curve)) for r in epochs]
    return final, {"seen": seen, "train_seconds": sum(r["epoch_seconds"] for r in epochs),
                   "epochs": sum(r["epoch_fraction"] for r in epochs),
                   "seconds": final["budget_seconds"], "curve": points}  # fmt: skip


def machine() -> dict[str, Any]:
    cpu, cpuinfo = platform.processor() or platform.machine(), ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        names = [line for line in cpuinfo.splitlines() if line.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_bf16": cpu_multiplies_bf16(cpuinfo),  # what backend.precision=auto reads
            "torch": torch.__version__, "gpu": gpu, "python": platform.python_version(),
            "load_average": load}  # fmt: skip


def commit() -> str | None:
    """The git sha of the checkout, with ``-dirty`` when it has uncommitted changes."""
    describe = ["describe", "--always", "--abbrev=40", "--exclude=*", "--dirty"]  # no tag names
    try:
        command = ["git", "-C", str(ROOT), *describe]
        return subprocess.check_output(command, text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def new_report(suite: str, results: list[dict], ratios: dict, notes: list[str], **extra) -> dict:
    """The report; ``extra``: a suite's own top-level keys."""
    return {"suite": suite, "machine": machine(), "commit": commit(), "results": results,
            "ratios": ratios, "notes": notes, **extra}  # fmt: skip


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else ""
    return "" if value is None else str(value)


def to_markdown(report: dict, columns: list[str]) -> str:
    m, rows = report["machine"], report["results"]
    lines = [
        f"# schnet_ipu.bench {report['suite']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"bf16 dot products {'yes' if m.get('cpu_bf16') else 'no'}, "
        f"torch {m['torch']}, GPU {m['gpu']}, Python {m['python']}, "
        f"load average {m['load_average']}; commit {report['commit']}.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows),
        "",
    ]
    if report["ratios"]:
        lines += ["Ratios:", "", *(f"- {k}: {_cell(v)}" for k, v in report["ratios"].items()), ""]
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def figure(path: Path, panels: int, figsize: tuple[float, float]) -> Iterator[np.ndarray]:
    """A row of ``panels`` matplotlib axes (Agg), the figure saved at ``path`` on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=figsize)
    yield np.atleast_1d(axes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bar_plot(report: dict, label: str, value: str, ylabel: str, path: Path) -> None:
    """One bar per result row: ``value`` against ``label``."""
    rows = [r for r in report["results"] if r.get(value) is not None]
    with figure(path, 1, (max(6, 0.6 * len(rows) + 2), 4.5)) as (ax,):
        ax.bar(range(len(rows)), [r[value] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), [str(r[label]) for r in rows], rotation=40, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(f"schnet_ipu.bench {report['suite']} ({report['machine']['cpu']})", fontsize=9)


def curve_plot(rows: list[dict], ylabels: list[str], out_dir: str | Path, name: str) -> None:
    """Each row's ``curve`` of (seconds, value, ...): a log-scale panel per value, in minutes."""
    with figure(Path(out_dir) / name, len(ylabels), (5.5 * len(ylabels) + 1.5, 4)) as axes:
        for row in rows:
            seconds, *values = (np.array(c) for c in zip(*row["curve"]))
            for ax, value in zip(axes, values):
                ax.plot(seconds / 60, value, "o-", ms=3, label=row["name"])
        for ax, ylabel in zip(axes, ylabels):
            ax.set(xlabel="minutes of training", ylabel=ylabel, yscale="log")
        axes[0].legend(fontsize=8)


def write_report(
    report: dict, columns: list[str], plot: tuple[str, str, str], out_dir: str | Path,
    json_path: str | Path | None = None,
) -> None:  # fmt: skip
    """Print the table and write ``<suite>.json``/``.md``/``.png`` (and ``json_path``)."""
    out_dir, suite, text = Path(out_dir), report["suite"], to_markdown(report, columns)
    print(text)
    # strict JSON: NaN and infinities read back as None (null)
    strict = json.loads(json.dumps(report, default=str), parse_constant=lambda _: None)
    for path in [out_dir / f"{suite}.json", *([Path(json_path)] if json_path else [])]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(strict, indent=2))
    (out_dir / f"{suite}.md").write_text(text)
    bar_plot(report, *plot, out_dir / f"{suite}.png")
