"""Molecular data: importers into one HDF5 store, splits and neighbour graphs. The package
hands on the names users' scripts take from it: ``MoleculeStore(ensure_store(cfg.data))``."""

from .ase_files import import_ase
from .checks import StoreError
from .graphs import knn_edges, molecule_pairs, radius_edges
from .hydronet import import_hydronet
from .pairs import edge_counts, radius_pairs
from .pairs_file import RadiusPairs
from .qm9 import import_qm9, import_qm9_raw
from .sources import ensure_store
from .splits import load_or_make_split, make_split
from .store import MoleculeStore
from .water import generate_water
from .water_sampled import generate_water_sampled, hydronet_weights
from .writer import write_store

__all__ = [
    "MoleculeStore",
    "RadiusPairs",
    "StoreError",
    "edge_counts",
    "ensure_store",
    "generate_water",
    "generate_water_sampled",
    "hydronet_weights",
    "import_ase",
    "import_hydronet",
    "import_qm9",
    "import_qm9_raw",
    "knn_edges",
    "load_or_make_split",
    "make_split",
    "molecule_pairs",
    "radius_edges",
    "radius_pairs",
    "write_store",
]
