"""QM9 importers: from the qm9pack CSVs (offline default) and from PyG's raw files.

Both produce the same store: molecules ordered by gdb index (``ids``), positions in Angstrom,
targets in the units of :data:`TARGETS` and atomrefs (eV) for U0, U, H and G.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .checks import StoreError
from .elements import ATOMIC_NUMBER, NUM_ELEMENTS
from .writer import write_store

log = logging.getLogger(__name__)

HARTREE_EV = 27.211386

# name: (unit, description, qm9pack column, PyG raw csv column, factor from source unit)
TARGETS: dict[str, tuple[str, str, str, str, float]] = {
    "mu": ("D", "dipole moment", "Dipole_debye", "mu", 1.0),
    "alpha": ("a0^3", "isotropic polarizability", "Polarizability_bohr3", "alpha", 1.0),
    "homo": ("eV", "HOMO energy", "HOMO_au", "homo", HARTREE_EV),
    "lumo": ("eV", "LUMO energy", "LUMO_au", "lumo", HARTREE_EV),
    "gap": ("eV", "HOMO-LUMO gap", "HOMO_LUMO_gap_au", "gap", HARTREE_EV),
    "r2": ("a0^2", "electronic spatial extent", "R2_bohr2", "r2", 1.0),
    "zpve": ("eV", "zero point vibrational energy", "ZPVE_au", "zpve", HARTREE_EV),
    "U0": ("eV", "internal energy at 0 K", "InternalEnergy_0K_au", "u0", HARTREE_EV),
    "U": ("eV", "internal energy at 298.15 K", "InternalEnergy_298K_au", "u298", HARTREE_EV),
    "H": ("eV", "enthalpy at 298.15 K", "Enthalphy_298K_au", "h298", HARTREE_EV),
    "G": ("eV", "free energy at 298.15 K", "GibbsFreeEnergy_298K_au", "g298", HARTREE_EV),
    "Cv": ("cal/mol/K", "heat capacity at 298.15 K", "Heatcapacity_Cv_cal_mol_K", "cv", 1.0),
    "A": ("GHz", "rotational constant A", "RotA_GHz", "A", 1.0),
    "B": ("GHz", "rotational constant B", "RotB_GHz", "B", 1.0),
    "C": ("GHz", "rotational constant C", "RotC_GHz", "C", 1.0),
}

# B3LYP/6-31G(2df,p) energies of the free atoms (QM9 atomref table), Hartree.
ATOMREF_HARTREE: dict[str, dict[str, float]] = {
    "U0": {"H": -0.500273, "C": -37.846772, "N": -54.583861, "O": -75.064579, "F": -99.718730},
    "U": {"H": -0.498857, "C": -37.845355, "N": -54.582445, "O": -75.063162, "F": -99.717314},
    "H": {"H": -0.497912, "C": -37.844411, "N": -54.581501, "O": -75.062219, "F": -99.716370},
    "G": {"H": -0.510927, "C": -37.861317, "N": -54.598897, "O": -75.079532, "F": -99.733544},
}

QM9PACK_FILES = ("qm9_part1.csv", "qm9_part2.csv", "qm9_part3.csv")
NUM_QM9 = 130_831

_STRIP_LIST = str.maketrans("", "", "[]' \"")


def qm9pack_dir() -> Path:
    """The qm9pack data folder (found without importing qm9pack, which needs pkg_resources)."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None or not spec.submodule_search_locations:
        raise StoreError("qm9pack is not installed: pip install qm9pack==1.0.3")
    return Path(spec.submodule_search_locations[0]) / "data"


def atomrefs_ev() -> dict[str, np.ndarray]:
    """Per-element reference energies [119] in eV (index = atomic number) for U0, U, H, G."""
    out = {}
    for name, table in ATOMREF_HARTREE.items():
        ref = np.zeros(NUM_ELEMENTS)
        for symbol, energy in table.items():
            ref[ATOMIC_NUMBER[symbol]] = energy * HARTREE_EV
        out[name] = ref
    return out


def import_qm9(
    out: str | Path, limit: int | None = None, progress: bool = True, skip_invalid: bool = False
) -> Path:
    """Import QM9 from qm9pack into a store at ``out``; ``limit`` keeps the first N rows;
    ``skip_invalid`` drops (and lists) invalid records instead of refusing the import."""
    folder = qm9pack_dir()
    ids, counts, symbols, coords = [], [], [], []
    columns = {name: [] for name in TARGETS}
    total = NUM_QM9 if limit is None else min(limit, NUM_QM9)
    bar = tqdm(total=total, desc="qm9pack", unit="mol", disable=not progress, file=sys.stderr)
    for file, line, row in _qm9pack_rows(folder, limit):
        where = f"{file}:{line}"
        try:
            n = int(row["N_atoms"])
            elements = row["Elements"].translate(_STRIP_LIST)
            xyz = row["XYZ_Ang"].translate(_STRIP_LIST)
            n_elements = elements.count(",") + 1 if elements else 0
            n_coords = xyz.count(",") + 1 if xyz else 0
            if n_elements != n or n_coords != 3 * n:
                raise StoreError(
                    f"{where}: N_atoms={n} but {n_elements} elements, {n_coords} coords"
                )
            for name, (_, _, column, _, factor) in TARGETS.items():
                columns[name].append(float(row[column]) * factor)
            ids.append(int(row["Index"]))
        except (KeyError, ValueError) as err:
            raise StoreError(f"{where}: malformed QM9 row: {err}") from err
        counts.append(n)
        symbols.append(elements)
        coords.append(xyz)
        bar.update()
    bar.close()
    z = np.array(",".join(s for s in symbols if s).split(","))
    pos = _parse_floats(",".join(c for c in coords if c), folder).reshape(-1, 3)
    version = _qm9pack_version()
    return _write_qm9(out, ids, counts, z, pos, columns, "qm9pack", version, folder, skip_invalid)


def _qm9pack_rows(folder: Path, limit: int | None) -> Iterator[tuple[str, int, dict[str, str]]]:
    done = 0
    for name in QM9PACK_FILES:
        path = folder / name
        if not path.is_file():
            raise StoreError(
                f"{path}: qm9pack file not found (expected {', '.join(QM9PACK_FILES)})"
            )
        with open(path, newline="") as f:
            for line, row in enumerate(csv.DictReader(f), start=2):
                if limit is not None and done >= limit:
                    return
                yield str(path), line, row
                done += 1


def _qm9pack_version() -> str:
    try:
        return metadata.version("qm9pack")
    except metadata.PackageNotFoundError:
        return "unknown"


def _parse_floats(text: str, where: Path) -> np.ndarray:
    if not text:
        return np.zeros(0)
    try:
        return np.array(text.split(","), dtype=np.float64)
    except ValueError as err:
        raise StoreError(f"{where}: bad coordinate value: {err}") from err


def _write_qm9(out, ids, counts, z, pos, columns, source, version, origin, skip_invalid) -> Path:
    """Sort by gdb id and write; shared by both importers."""
    ids = np.asarray(ids, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    order = np.argsort(ids, kind="stable")
    if np.any(order != np.arange(len(order))):
        atom_order = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in order])
        z, pos, ids, counts = z[atom_order], pos[atom_order], ids[order], counts[order]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        columns = {name: np.asarray(v)[order] for name, v in columns.items()}
    path = write_store(
        out,
        z,
        pos,
        targets=columns,
        units={name: spec[0] for name, spec in TARGETS.items()},
        descriptions={name: spec[1] for name, spec in TARGETS.items()},
        offsets=offsets,
        ids=ids,
        attrs={"source": source, "source_version": version, "synthetic": False},
        atomrefs=atomrefs_ev(),
        origin=str(origin),
        skip_invalid=skip_invalid,
    )
    log.info("wrote %s: %d molecules, %d atoms", path, len(ids), offsets[-1])
    return path


def import_qm9_raw(
    raw_dir: str | Path, out: str | Path, progress: bool = True, skip_invalid: bool = False
) -> Path:
    """Import QM9 from PyG's raw files (gdb9.sdf, gdb9.sdf.csv, uncharacterized.txt).

    Uncharacterized molecules are skipped (as PyG does); the csv's energies are Hartree.
    """
    raw_dir = Path(raw_dir)
    names = ("gdb9.sdf", "gdb9.sdf.csv", "uncharacterized.txt")
    missing = [n for n in names if not (raw_dir / n).is_file()]
    if missing:
        raise StoreError(f"{raw_dir}: missing QM9 raw files {missing} (expected {list(names)})")
    skip = _read_uncharacterized(raw_dir / "uncharacterized.txt")
    table = _read_raw_csv(raw_dir / "gdb9.sdf.csv")
    ids, counts, symbols, coords = [], [], [], []
    columns = {name: [] for name in TARGETS}
    for gdb_id, elements, xyz in tqdm(
        _read_sdf(raw_dir / "gdb9.sdf"), desc="gdb9.sdf", unit="mol", disable=not progress
    ):
        if gdb_id in skip:
            continue
        if gdb_id not in table:
            raise StoreError(f"{raw_dir / 'gdb9.sdf.csv'}: no row for molecule gdb_{gdb_id}")
        for name, value in zip(TARGETS, table[gdb_id]):
            columns[name].append(value)
        ids.append(gdb_id)
        counts.append(len(elements))
        symbols.extend(elements)
        coords.extend(xyz)
    z = np.array(symbols, dtype=str)
    pos = np.array(coords, dtype=np.float64).reshape(-1, 3)
    return _write_qm9(
        out, ids, counts, z, pos, columns, "qm9-raw", "pyg-raw", raw_dir, skip_invalid
    )


def _read_uncharacterized(path: Path) -> set[int]:
    """gdb ids listed in uncharacterized.txt: 9 header lines, then one molecule per line."""
    skip = set()
    for line in path.read_text().splitlines()[9:]:
        tokens = line.split()
        if tokens and tokens[0].isdigit():
            skip.add(int(tokens[0]))
    return skip


def _read_raw_csv(path: Path) -> dict[int, list[float]]:
    """gdb id -> target values (store units) from gdb9.sdf.csv (mol_id, A, B, C, mu, ...)."""
    table = {}
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                gdb_id = int(row["mol_id"].split("_")[-1])
                table[gdb_id] = [
                    float(row[column]) * factor for _, _, _, column, factor in TARGETS.values()
                ]
            except (KeyError, ValueError, TypeError) as err:
                raise StoreError(f"{path}:{line}: malformed row: {err}") from err
    return table


def _read_sdf(path: Path) -> Iterator[tuple[int, list[str], list[float]]]:
    """Yield (gdb id, element symbols [n], flat coordinates [3n]) per V2000 mol block."""
    with open(path) as f:
        block: list[str] = []
        start = 1
        for number, line in enumerate(f, start=1):
            if line.startswith("$$$$"):
                yield _parse_mol_block(block, f"{path}:{start}")
                block, start = [], number + 1
            else:
                block.append(line)
        if any(line.strip() for line in block):
            raise StoreError(f"{path}:{start}: mol block not terminated by $$$$")


def _parse_mol_block(lines: list[str], where: str) -> tuple[int, list[str], list[float]]:
    try:
        gdb_id = int(lines[0].strip().split("_")[-1])
        n = int(lines[3][:3])
        elements, xyz = [], []
        for line in lines[4 : 4 + n]:
            x, y, z, symbol = line.split()[:4]
            elements.append(symbol)
            xyz += [float(x), float(y), float(z)]
    except (IndexError, ValueError) as err:
        raise StoreError(f"{where}: malformed mol block: {err}") from err
    if len(elements) != n:
        raise StoreError(f"{where}: mol block promises {n} atoms, has {len(elements)}")
    return gdb_id, elements, xyz
