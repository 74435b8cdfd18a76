"""Shared pieces of the benchmark suites: configs, timing, machine facts and reports.

Every suite returns a report dict ``{"suite", "machine", "commit", "results", "ratios",
"notes"}``; :func:`write_report` prints its table and writes the JSON, markdown and PNG.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from schnet_ipu import components
from schnet_ipu.backends import ReplicaInfo
from schnet_ipu.config import Config, ModelConfig, apply_override, validate
from schnet_ipu.loader import PackedLoader
from schnet_ipu.pipeline import PreparedData

QM9_STORE = "data/qm9.h5"


@dataclass
class Timing:
    """How long a measurement runs: ``warmup`` steps untimed, then ``repeats`` x ``steps``."""

    warmup: int = 3
    steps: int = 10
    repeats: int = 3


@dataclass
class Rate:
    """Median molecules/s and seconds per step over the timed repeats."""

    molecules_per_s: float
    step_seconds: float
    molecules_per_step: float
    repeats: list[float] = field(default_factory=list)


def bench_config(store: str | Path, sample: int, size: ModelConfig, overrides: list[str]) -> Config:
    """A validated config on a fixed random ``sample`` of the store's training molecules.

    ``data.subset`` draws the sample (with small val/test shares the split needs); the
    split file beside the store makes it the same molecules for every variant.
    """
    cfg = Config(model=replace(size))  # the model under test; overrides pick its graph
    base = [
        f"data.path={store}",
        f"data.subset={round(sample / 0.9)}",
        "data.val=0.05",
        "data.test=0.05",
        "optim.grad_clip=0",
        "backend.device=cpu",
        "logging.progress=false",
    ]
    for item in [*base, *overrides]:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def molecules_per_pack(data: PreparedData) -> float:
    return len(data.split["train"]) / data.train_plan.num_packs


def packs_for(data: PreparedData, molecules_per_batch: float) -> int:
    """Packs per batch giving about ``molecules_per_batch`` molecules per step."""
    return max(1, round(molecules_per_batch / molecules_per_pack(data)))


def make_trainer(cfg: Config, data: PreparedData, replica: ReplicaInfo | None = None):
    """The backend of the trainer's own setup (model, fused Adam, standardised loss)."""
    return components.make_trainer(cfg, data, replica)[2]


def host_calls(loader: PackedLoader) -> Iterator[list]:
    """Host calls of the loader, epoch after epoch, forever."""
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def training_step(loader: PackedLoader, backend) -> Callable[[], int]:
    """One host call: the next micro-batches from the loader, then ``train_call``."""
    calls = host_calls(loader)

    def step() -> int:
        return sum(r["molecules"] for r in backend.train_call(next(calls)))

    return step


def measure(step: Callable[[], int], timing: Timing) -> Rate:
    """Run ``step`` (returns molecules processed) ``warmup`` times, then time ``repeats``
    windows of ``steps`` calls; medians over the windows."""
    return measure_side_by_side({"": step}, timing)[""]


def measure_side_by_side(steps: dict[str, Callable[[], int]], timing: Timing) -> dict[str, Rate]:
    """Warm every step up, then per repeat time one window of each in turn, so a change in
    the machine's load hits every variant alike; medians over the windows."""
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
    return {
        name: Rate(
            statistics.median(count / seconds for seconds, count in w),
            statistics.median(seconds / timing.steps for seconds, _ in w),
            statistics.median(count / timing.steps for _, count in w),
            [count / seconds for seconds, count in w],
        )
        for name, w in windows.items()
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


# --- machine and commit ---------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def commit() -> str | None:
    """The git sha of the checkout, with ``-dirty`` when it has uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def new_report(suite: str, results: list[dict], ratios: dict, notes: list[str]) -> dict:
    return {
        "suite": suite,
        "machine": machine(),
        "commit": commit(),
        "results": results,
        "ratios": ratios,
        "notes": notes,
    }


# --- output ---------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else ""
    return "" if value is None else str(value)


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def format_table(rows: list[dict], columns: list[str]) -> list[str]:
    """Markdown table lines of ``columns`` of ``rows``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def to_markdown(report: dict, columns: list[str]) -> str:
    m = report["machine"]
    lines = [
        f"# schnet_ipu.bench {report['suite']}",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"torch {m['torch']}, GPU {m['gpu']}, Python {m['python']}, "
        f"load average {m['load_average']}; commit {report['commit']}.",
        "",
        *format_table(report["results"], columns),
        "",
    ]
    if report["ratios"]:
        lines += ["Ratios:", ""]
        lines += [f"- {k}: {_cell(v)}" for k, v in report["ratios"].items()]
        lines.append("")
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def bar_plot(report: dict, label: str, value: str, ylabel: str, path: Path) -> None:
    """One bar per result row: ``value`` against ``label``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get(value) is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.5))
    ax.bar(range(len(rows)), [r[value] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [str(r[label]) for r in rows], rotation=40, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(f"schnet_ipu.bench {report['suite']} ({report['machine']['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(
    report: dict,
    columns: list[str],
    plot: tuple[str, str, str],
    out_dir: str | Path,
    json_path: str | Path | None = None,
) -> str:
    """Print the table, write ``<suite>.json``/``.md``/``.png`` in ``out_dir`` (and the JSON
    at ``json_path`` too); returns the markdown."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = to_markdown(report, columns)
    print(text)
    payload = json.dumps(json_safe(report), indent=2, default=str, allow_nan=False)
    suite = report["suite"]
    (out_dir / f"{suite}.json").write_text(payload)
    (out_dir / f"{suite}.md").write_text(text)
    bar_plot(report, *plot, out_dir / f"{suite}.png")
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(payload)
    return text
