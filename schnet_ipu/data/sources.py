"""The store a config names: ``ensure_store(cfg.data)`` imports ``data.source`` into
``data.path`` when the file is missing (qm9, qm9-raw, hydronet, water, ase)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from schnet_ipu.config import DataConfig

from .ase_files import import_ase
from .checks import StoreError
from .hydronet import import_hydronet
from .qm9 import import_qm9, import_qm9_raw
from .water import generate_water
from .water_sampled import generate_water_sampled, hydronet_weights

log = logging.getLogger(__name__)


def ensure_store(data_cfg: DataConfig, progress: bool = True) -> Path:
    """Return ``data_cfg.path``, importing ``data_cfg.source`` into it first when missing."""
    path = Path(data_cfg.path)
    if path.exists():
        return path
    source = data_cfg.source
    if source in ("qm9-raw", "hydronet") and not data_cfg.raw_dir:
        raise StoreError(f"{path} is missing and data.source={source} needs data.raw_dir")
    log.info("%s not found: importing data.source=%s", path, source)
    start = time.perf_counter()
    if source == "qm9":
        import_qm9(path, progress=progress)
    elif source == "qm9-raw":
        import_qm9_raw(data_cfg.raw_dir, path, progress=progress)
    elif source == "hydronet":
        import_hydronet(data_cfg.raw_dir, path, data_cfg.hydronet_subset, progress=progress)
    elif source == "water" and data_cfg.water_templates:
        generate_water_sampled(
            path,
            data_cfg.water_clusters,
            tuple(data_cfg.water_sizes),
            templates=data_cfg.water_templates,
            distribution=data_cfg.water_distribution,
            progress=progress,
        )
    elif source == "ase":
        import_ase(data_cfg.files, path, data_cfg.energy_key, data_cfg.forces_key, progress)
    elif source == "water":
        lo, hi = data_cfg.water_sizes
        weights = None
        if data_cfg.water_distribution == "hydronet":
            weights = [hydronet_weights().get(w, 0.0) for w in range(lo, hi + 1)]
        generate_water(path, data_cfg.water_clusters, (lo, hi), seed=0, weights=weights)
    else:
        raise StoreError(f"unknown data.source {source!r} (qm9, qm9-raw, hydronet, water, ase)")
    log.info("imported %s into %s in %.1f s", source, path, time.perf_counter() - start)
    return path
