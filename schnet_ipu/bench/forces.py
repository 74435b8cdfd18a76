"""Force fields at equal wall time: our trainer against schnetpack 2.1.1's SchNet.

    python -m schnet_ipu.bench forces [--config configs/emt_forces.yaml] [--minutes 1.5]
        [--set section.key=value ...] [--variant "NAME: key=value key=value" ...]
        [--parallel 2] [--out-dir DIR]

On a force config's frames and split, same model size: ours (the config with
``optim.max_minutes=M``, ``train.py``'s loop), schnetpack with its stock MD17-style recipe
(:mod:`schnet_ipu.bench.schnetpack_side`) and ``--variant`` rows of ours (the config plus
the variant's overrides). Sides run as processes, ``--parallel`` at a time, one torch thread
each; rows: structures/s, test energy and force MAE, the 1-minute load average of their
wave; ``forces_vs_time.png`` draws the validation curves. schnetpack is a bench-only extra
(``pip install -e .[bench]``); without it the suite stops with one line.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from schnet_ipu.bench import common
from schnet_ipu.config import Config, load_config
from schnet_ipu.errors import UserError
from schnet_ipu.pipeline import PreparedData, prepare_data

DEFAULT_CONFIG = common.ROOT / "configs/emt_forces.yaml"
OURS = "ours"
COLUMNS = ["name", "minutes", "structures_per_s", "test_energy_mae_meV_per_atom",
           "test_energy_mae_eV", "test_force_mae", "structures_seen", "epochs",
           "load_1min"]  # fmt: skip
PLOT = ("name", "test_force_mae", "test force MAE after equal wall time (eV/A)")
QUICK = {"minutes": 0.25}
FORCES_PLOT = ["validation force MAE (eV/A)", "validation energy MAE (eV)"]


def force_config(path: str | Path, overrides: list[str]) -> Config:
    """The force config at ``path`` with ``overrides``; refuses a config without forces."""
    cfg = load_config(path, [*overrides, "logging.progress=false", "logging.plot=false"])
    if not cfg.data.forces_key or cfg.optim.forces_weight <= 0:
        raise UserError(f"{path}: bench forces needs a force config (optim.forces_weight > 0)")
    return cfg


def store_frames(data: PreparedData, target: str) -> dict[str, list]:
    """Every frame of the store in its order: ``z`` [n], ``pos`` [n, 3], ``energy`` (eV, the
    store's target as imported), ``forces`` [n, 3] (eV/A), ``cell`` [3, 3], ``pbc`` [3]."""
    store = data.store
    energy, forces = store.target(target), store.forces()
    cells, pbc = store.cells()
    z, pos = zip(*(store.molecule(i) for i in range(len(store))))
    offsets = store.offsets
    return {"z": list(z), "pos": list(pos), "energy": [float(e) for e in energy],
            "forces": [forces[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            "cell": list(cells), "pbc": list(pbc)}  # fmt: skip


def write_split(data: PreparedData, path: Path) -> None:
    """The store's split as schnetpack's ``split.npz`` (train_idx, val_idx, test_idx)."""
    np.savez(path, **{f"{name}_idx": data.split[name] for name in ("train", "val", "test")})


def train_ours(cfg: Config, minutes: float, run_dir: Path, name: str = OURS) -> dict:
    """Our trainer on ``cfg`` for ``minutes``: a result row with the validation curve."""
    final, epochs = common.train_for(cfg, minutes, run_dir)
    seen = sum(r["molecules_per_s"] * r["epoch_seconds"] for r in epochs)
    return {
        "name": name,
        **{key: final[key] for key in ("test_mae", "test_energy_mae_per_atom", "test_force_mae")},
        "structures_per_s": seen / max(sum(r["epoch_seconds"] for r in epochs), 1e-9),
        "structures_seen": seen,
        "epochs": sum(r["epoch_fraction"] for r in epochs),
        "seconds": final["budget_seconds"],
        "curve": [(r["budget_seconds"], r["val_force_mae"], r["val_mae"]) for r in epochs],
    }


def _side(job: dict) -> dict:
    """One side in its own process: its row."""
    if job["side"] == OURS:
        return train_ours(job["cfg"], job["minutes"], Path(job["run_dir"]), job["name"])
    from schnet_ipu.bench.schnetpack_side import train_schnetpack

    os.chdir(Path(job["database"]).parent)  # its data module locks splitting.lock in "."
    return train_schnetpack(job["model"], job["database"], job["split"], job["minutes"])


def run_sides(jobs: list[dict], parallel: int) -> list[dict]:
    """``jobs`` in fresh spawned processes, ``parallel`` at a time; their rows in order, each
    with the 1-minute load average at the end of its wave."""
    rows = []
    for start in range(0, len(jobs), parallel):
        wave = jobs[start : start + parallel]
        with ProcessPoolExecutor(len(wave), multiprocessing.get_context("spawn")) as sides:
            done = list(sides.map(_side, wave))
        load = os.getloadavg()[0]
        rows += [{**row, "load_1min": load} for row in done]
    return rows


def with_units(row: dict, minutes: float) -> dict:
    """``row`` with the report's columns: minutes, energy MAE in meV/atom and eV."""
    return {
        **row,
        "minutes": minutes,
        "test_energy_mae_meV_per_atom": 1000.0 * row["test_energy_mae_per_atom"],
        "test_energy_mae_eV": row["test_mae"],
    }


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME: key=value key=value"`` -> (NAME, overrides)."""
    name, sep, overrides = text.partition(":")
    if not sep or not name.strip():
        raise UserError(f"--variant {text!r} must look like 'NAME: section.key=value ...'")
    return name.strip(), overrides.split()


def run(
    minutes: float = 1.5, config: str | Path = DEFAULT_CONFIG,
    overrides: list[str] | None = None, variants: list[str] | None = None, parallel: int = 2,
    out_dir: str | Path = "bench_results",
) -> dict:  # fmt: skip
    """Both sides for ``minutes`` on ``config``'s frames (the config names the data)."""
    if importlib.util.find_spec("schnetpack") is None:
        raise UserError(
            "bench forces needs schnetpack 2.1.1, a bench-only extra: pip install -e .[bench] "
            "(see pyproject.toml)"
        )
    cfg = force_config(config, list(overrides or []))
    data = prepare_data(cfg)  # the store and its split, before the sides read them
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        from schnet_ipu.bench.schnetpack_side import write_database

        write_database(store_frames(data, cfg.data.target), data.dressed_atoms, folder / "db.db")
        write_split(data, folder / "split.npz")
        jobs = [
            {"side": "schnetpack", "name": "schnetpack 2.1.1", "model": cfg.model,
             "database": folder / "db.db", "split": folder / "split.npz", "minutes": minutes},
            {"side": OURS, "name": OURS, "cfg": cfg, "minutes": minutes,
             "run_dir": str(folder / "ours")},
        ]  # fmt: skip
        for k, text in enumerate(variants or []):
            name, extra = parse_variant(text)
            variant = force_config(config, [*(overrides or []), *extra])
            jobs.append(
                {"side": OURS, "name": f"ours: {name}", "cfg": variant, "minutes": minutes,
                 "run_dir": str(folder / f"variant{k}")}
            )  # fmt: skip
        rows = [with_units(row, minutes) for row in run_sides(jobs, parallel)]
    stock, mine = rows[0], rows[1]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common.curve_plot(rows, FORCES_PLOT, out / "forces_vs_time.png")
    ratios = {
        "force_mae_ours_over_schnetpack": common.ratio(
            mine["test_force_mae"], stock["test_force_mae"]
        ),
        "energy_mae_ours_over_schnetpack": common.ratio(mine["test_mae"], stock["test_mae"]),
        "throughput_ours_over_schnetpack": common.ratio(
            mine["structures_per_s"], stock["structures_per_s"]
        ),
    }
    split = {name: len(index) for name, index in data.split.items()}
    notes = [
        f"{minutes} min each on {cfg.data.files} ({split}), {parallel} side(s) at a time, "
        f"one torch thread each; model {cfg.model.hidden_channels}/{cfg.model.num_filters}/"
        f"{cfg.model.num_interactions}/{cfg.model.num_gaussians}, cutoff {cfg.model.cutoff}",
        f"ours: {config} {' '.join(overrides or [])}; packs_per_batch "
        f"{cfg.packing.packs_per_batch}, lr {cfg.optim.lr} {cfg.optim.schedule}, forces_weight "
        f"{cfg.optim.forces_weight}, ema_decay {cfg.optim.ema_decay}; schnetpack: "
        f"{stock['recipe']}; errors: best-validation weights on the test split",
    ]
    return common.new_report("forces", rows, ratios, notes)
