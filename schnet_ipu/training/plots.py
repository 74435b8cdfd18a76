"""Evaluation pictures: parity plots (predicted vs true) and error histograms, as PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def evaluation_plots(
    run_dir: Path,
    split: str,
    energy: tuple[np.ndarray, np.ndarray],
    unit: str,
    forces: tuple[np.ndarray, np.ndarray] | None = None,
    forces_unit: str = "",
) -> list[Path]:
    """Write ``parity_SPLIT.png`` and ``errors_SPLIT.png`` in ``run_dir``; returns the paths.

    ``energy`` is (predicted [M], true [M]); ``forces`` (predicted [A, 3], true [A, 3]) adds a
    panel for the force components to each figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("energy", *energy, unit)]
    if forces is not None:
        panels.append(("force components", *(f.reshape(-1) for f in forces), forces_unit))
    paths = [run_dir / f"parity_{split}.png", run_dir / f"errors_{split}.png"]
    parity, parity_axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    errors, error_axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
    for (name, pred, true, u), pa, ea in zip(
        panels, np.atleast_1d(parity_axes), np.atleast_1d(error_axes)
    ):
        error = pred - true
        mae = float(np.mean(np.abs(error)))
        lo, hi = float(min(pred.min(), true.min())), float(max(pred.max(), true.max()))
        pa.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        pa.scatter(true, pred, s=4, alpha=0.5)
        pa.set(xlabel=f"true {name} ({u})", ylabel=f"predicted {name} ({u})")
        pa.set_title(f"{split}: {name}, MAE {mae:.4g} {u}")
        ea.hist(error, bins=60)
        ea.set(xlabel=f"{name} error ({u})", ylabel="count")
        ea.set_title(f"{split}: {name} error, MAE {mae:.4g} {u}")
    for figure, path in zip((parity, errors), paths):
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
    return paths
