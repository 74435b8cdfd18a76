"""Force fields at equal wall time: our trainer against a peer on a force config's frames and
split: ours (the config under ``optim.max_minutes=M``), the ``--peer`` (``schnetpack``, the
default: schnetpack 2.1.1's SchNet of our model's size in its stock MD17-style recipe,
:mod:`.schnetpack_side`; ``mace``: a small MACE in mace's own recipe, :mod:`.mace_side`;
``both``) and ``--variant`` rows of ours; sides are processes, ``--parallel`` at a time, one
thread each. The committed reports: docs/benchmarks/forces/ (``mace-*`` against MACE: it
is ahead per structure seen on the xTB frames, 27-93x slower per structure); their figures:
docs/benchmarks/README.md."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from schnet_ipu.bench import common
from schnet_ipu.config import Config, load_config
from schnet_ipu.errors import UserError
from schnet_ipu.training.data import PreparedData, prepare_data

COLUMNS = ["name", "minutes", "structures_per_s", "test_energy_mae_meV_per_atom",
           "test_energy_mae_eV", "test_force_mae", "structures_seen", "epochs",
           "load_1min"]  # fmt: skip
PLOT = ("name", "test_force_mae", "test force MAE after equal wall time (eV/A)")
QUICK = {"minutes": 0.25}
FORCES_PLOT = ["validation force MAE (eV/A)", "validation energy MAE (eV)"]
# --peer: the package each peer's side imports, and how to install it
PACKAGES = {"schnetpack": "pip install -e .[bench] && pip install --no-deps schnetpack==2.1.1",
            "mace": "pip install -e .[bench] (mace-torch 0.3.16)"}  # fmt: skip
PEERS = (*PACKAGES, "both")


def force_config(path: str | Path, overrides: list[str]) -> Config:
    """The force config at ``path`` with ``overrides``; refuses one without forces."""
    cfg = load_config(path, [*overrides, "logging.progress=false", "logging.plot=false"])
    if not cfg.data.forces_key or cfg.optim.forces_weight <= 0:
        raise UserError(f"{path}: bench forces needs a force config (optim.forces_weight > 0)")
    return cfg


def store_frames(data: PreparedData, target: str) -> dict[str, list]:
    """Every frame in store order: z, pos, energy (eV), forces (eV/A), cell and pbc lists."""
    store = data.store
    energy, forces = store.target(target), store.forces()
    cells, pbc = store.cells()
    z, pos = zip(*(store.molecule(i) for i in range(len(store))))
    return {"z": list(z), "pos": list(pos), "energy": [float(e) for e in energy],
            "forces": [forces[a:b] for a, b in zip(store.offsets[:-1], store.offsets[1:])],
            "cell": list(cells), "pbc": list(pbc)}  # fmt: skip


def write_split(data: PreparedData, path: Path) -> None:
    """The store's split as schnetpack's ``split.npz`` (train_idx, val_idx, test_idx)."""
    np.savez(path, **{f"{name}_idx": data.split[name] for name in ("train", "val", "test")})


def train_ours(cfg: Config, minutes: float, run_dir: Path, name: str = "ours") -> dict:
    """Our trainer on ``cfg`` for ``minutes``: a result row with the validation curve."""
    final, row = common.train_for(cfg, minutes, run_dir, ["val_force_mae", "val_mae"])
    seen, tests = row["seen"], ("test_mae", "test_energy_mae_per_atom", "test_force_mae")
    return {"name": name, **{key: final[key] for key in tests},
            "structures_per_s": seen / max(row["train_seconds"], 1e-9), "structures_seen": seen,
            **{key: row[key] for key in ("epochs", "seconds", "curve")}}  # fmt: skip


def with_units(row: dict, minutes: float) -> dict:
    """``row`` with the report's columns: minutes, energy MAE in meV/atom and eV."""
    return {**row, "minutes": minutes,
            "test_energy_mae_meV_per_atom": 1000.0 * row["test_energy_mae_per_atom"],
            "test_energy_mae_eV": row["test_mae"]}  # fmt: skip


def in_child(module: str, function: str, *args):
    """``module.function(*args)``, imported in the side's own process: the peer's package
    stays out of the parent and of our sides' processes."""
    return getattr(importlib.import_module(module), function)(*args)


def peer_sides(
    peers: list[str], cfg: Config, data: PreparedData, minutes: float, folder: Path
) -> list[Callable[[], dict]]:
    """Each peer's side on the store's frames and split, its inputs written under ``folder``."""
    sides = []
    if "schnetpack" in peers:
        from schnet_ipu.bench.schnetpack_side import train_schnetpack, write_database

        database, split = folder / "db.db", folder / "split.npz"
        write_database(store_frames(data, cfg.data.target), data.dressed_atoms, database)
        write_split(data, split)
        sides.append(functools.partial(train_schnetpack, cfg.model, database, split, minutes))
    if "mace" in peers:
        frames, split = store_frames(data, cfg.data.target), dict(data.split)
        sides.append(functools.partial(in_child, "schnet_ipu.bench.mace_side", "train_mace",
                                       frames, split, minutes, folder / "mace"))  # fmt: skip
    return sides


def run(
    minutes: float = 1.5, config: str | Path = common.FORCE_CONFIG,
    overrides: list[str] = (), variants: list[str] | None = None, parallel: int = 2,
    peer: str = "schnetpack", out_dir: str | Path = "bench_results",
) -> dict:  # fmt: skip
    if peer not in PEERS:
        raise UserError(f"--peer {peer}: not a peer; pick one of {', '.join(PEERS)}")
    peers = list(PACKAGES) if peer == "both" else [peer]
    for name in peers:
        if importlib.util.find_spec(name) is None:
            raise UserError(f"bench forces --peer {name} needs {name}, a bench-only extra: "
                            f"{PACKAGES[name]} (see pyproject.toml)")  # fmt: skip
    cfg = force_config(config, overrides)
    data = prepare_data(cfg)  # the store and its split, before the sides read them
    with tempfile.TemporaryDirectory() as folder:
        sides = peer_sides(peers, cfg, data, minutes, Path(folder))  # each row in a fresh process
        sides.append(functools.partial(train_ours, cfg, minutes, Path(folder, "ours")))
        for k, text in enumerate(variants or []):  # "NAME: key=value key=value"
            name, sep, extra = text.partition(":")
            if not sep or not name.strip():
                raise UserError(f"--variant {text!r} must look like 'NAME: section.key=value ...'")
            variant = force_config(config, [*overrides, *extra.split()])
            run_dir, label = Path(folder, f"variant{k}"), f"ours: {name.strip()}"
            sides.append(functools.partial(train_ours, variant, minutes, run_dir, label))
        rows = []
        for start in range(0, len(sides), parallel):  # fresh spawned processes, a wave at a time
            wave = sides[start : start + parallel]
            with ProcessPoolExecutor(len(wave), multiprocessing.get_context("spawn")) as pool:
                done = [future.result() for future in [pool.submit(side) for side in wave]]
            load = os.getloadavg()[0]  # the wave's
            rows += [with_units({**row, "load_1min": load}, minutes) for row in done]
    stock, mine = rows[: len(peers)], rows[len(peers)]
    common.curve_plot(rows, FORCES_PLOT, out_dir, "forces_vs_time.png")
    ratios = {
        f"{name}_ours_over_{peer_name}": common.ratio(mine[key], row[key])
        for peer_name, row in zip(peers, stock)
        for name, key in (("force_mae", "test_force_mae"), ("energy_mae", "test_mae"),
                          ("energy_mae_per_atom", "test_energy_mae_per_atom"),
                          ("throughput", "structures_per_s"))
    }  # fmt: skip
    split = {name: len(index) for name, index in data.split.items()}
    notes = [
        f"{minutes} min each on {cfg.data.files} ({split}), {parallel} side(s) at a time, "
        f"one torch thread each; our model {cfg.model.hidden_channels}/{cfg.model.num_filters}/"
        f"{cfg.model.num_interactions}/{cfg.model.num_gaussians}, cutoff {cfg.model.cutoff}",
        f"ours: {config} {' '.join(overrides)}; packs_per_batch "
        f"{cfg.packing.packs_per_batch}, lr {cfg.optim.lr} {cfg.optim.schedule}, forces_weight "
        f"{cfg.optim.forces_weight}, ema_decay {cfg.optim.ema_decay}; errors: best-validation "
        "weights on the test split",
        *(f"{row['name']}: {row['recipe']}" for row in stock),
    ]
    return common.new_report("forces", rows, ratios, notes)
