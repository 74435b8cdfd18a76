"""QM9 importers: qm9pack slice contents, and agreement with PyG-layout raw files."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from schnet_ipu.data import MoleculeStore, StoreError, import_qm9, import_qm9_raw
from schnet_ipu.data.qm9 import HARTREE_EV, qm9pack_dir

LIMIT = 300


@pytest.fixture(scope="module")
def qm9(tmp_path_factory) -> MoleculeStore:
    path = import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=LIMIT, progress=False)
    return MoleculeStore(path)


def qm9pack_rows(count: int) -> list[dict[str, str]]:
    with open(qm9pack_dir() / "qm9_part1.csv", newline="") as f:
        reader = csv.DictReader(f)
        return [next(reader) for _ in range(count)]


def test_slice_contents(qm9):
    assert len(qm9) == LIMIT
    assert qm9.attrs["source"] == "qm9pack" and qm9.attrs["synthetic"] is False
    np.testing.assert_array_equal(qm9.ids[:3], [1, 2, 3])
    z, pos = qm9.molecule(0)  # methane, from the first row of qm9_part1.csv
    np.testing.assert_array_equal(z, [6, 1, 1, 1, 1])
    np.testing.assert_allclose(pos[0], [-0.0126981359, 1.0858041578, 0.0080009958], atol=1e-6)
    assert qm9.unit("U0") == "eV" and qm9.unit("mu") == "D" and qm9.unit("Cv") == "cal/mol/K"
    assert qm9.target("U0")[0] == pytest.approx(-40.47893 * HARTREE_EV)
    assert qm9.target("gap")[0] == pytest.approx(0.5048 * HARTREE_EV)
    assert qm9.target("alpha")[0] == pytest.approx(13.21)
    assert np.all(np.diff(qm9.ids) > 0)


def test_atomrefs_give_atomization_energy(qm9):
    ref = qm9.atomref("U0")
    assert ref.shape == (119,) and ref[1] == pytest.approx(-13.6131, abs=1e-3)
    z, _ = qm9.molecule(0)
    atomization = qm9.target("U0")[0] - ref[z].sum()
    assert atomization == pytest.approx(-17.17, abs=0.01)  # methane, eV
    assert qm9.atomref("gap") is None
    for name in ("U", "H", "G"):
        assert qm9.atomref(name)[[1, 6, 7, 8, 9]].all()


def write_raw_fixture(raw: Path, rows: list[dict[str, str]], extra_id: int) -> None:
    """gdb9.sdf / gdb9.sdf.csv / uncharacterized.txt in PyG's layouts for ``rows``.

    Adds one extra molecule ``extra_id`` that uncharacterized.txt lists (must be skipped).
    """
    raw.mkdir()
    blocks, table = [], []
    records = [(int(r["Index"]), r) for r in rows] + [(extra_id, rows[0])]
    for gdb_id, row in records:
        elements = row["Elements"].strip("[]").replace("'", "").split(",")
        xyz = np.array(row["XYZ_Ang"].strip("[]").replace("[", "").replace("]", "").split(","))
        xyz = xyz.astype(float).reshape(-1, 3)
        lines = [f"gdb_{gdb_id}", "     RDKit          3D", ""]
        lines.append(f"{len(elements):3d}  0  0  0  0  0  0  0  0  0999 V2000")
        for symbol, (x, y, z) in zip(elements, xyz, strict=True):
            lines.append(
                f"{x:10.4f}{y:10.4f}{z:10.4f} {symbol:<3} 0  0  0  0  0  0  0  0  0  0  0  0"
            )
        lines += ["M  END", "$$$$"]
        blocks.append("\n".join(lines))
        columns = [
            "RotA_GHz", "RotB_GHz", "RotC_GHz", "Dipole_debye", "Polarizability_bohr3",
            "HOMO_au", "LUMO_au", "HOMO_LUMO_gap_au", "R2_bohr2", "ZPVE_au",
            "InternalEnergy_0K_au", "InternalEnergy_298K_au", "Enthalphy_298K_au",
            "GibbsFreeEnergy_298K_au", "Heatcapacity_Cv_cal_mol_K",
        ]  # fmt: skip
        table.append([f"gdb_{gdb_id}", *(row[c] for c in columns), "0", "0", "0", "0"])
    (raw / "gdb9.sdf").write_text("\n".join(blocks) + "\n")
    header = "mol_id,A,B,C,mu,alpha,homo,lumo,gap,r2,zpve,u0,u298,h298,g298,cv,"
    header += "u0_atom,u298_atom,h298_atom,g298_atom"
    (raw / "gdb9.sdf.csv").write_text(header + "\n" + "\n".join(",".join(r) for r in table) + "\n")
    head = [" Uncharacterized molecules"] + [" header"] * 8
    body = [f" {extra_id:5d}  C4H4  x  y  z"]
    (raw / "uncharacterized.txt").write_text("\n".join([*head, *body, " ====", ""]))


def test_raw_files_agree_with_qm9pack(qm9, tmp_path):
    rows = qm9pack_rows(40)
    write_raw_fixture(tmp_path / "raw", rows, extra_id=999_999)
    raw = MoleculeStore(import_qm9_raw(tmp_path / "raw", tmp_path / "raw.h5", progress=False))
    assert len(raw) == 40 and 999_999 not in raw.ids
    assert raw.attrs["source"] == "qm9-raw"
    assert raw.target_names == qm9.target_names
    shared = np.searchsorted(qm9.ids, raw.ids)
    np.testing.assert_array_equal(qm9.ids[shared], raw.ids)
    for name in raw.target_names:
        assert raw.unit(name) == qm9.unit(name)
        np.testing.assert_allclose(raw.target(name), qm9.target(name)[shared], rtol=1e-12)
        ref = raw.atomref(name)
        assert (ref is None) == (qm9.atomref(name) is None)
    for i, j in enumerate(shared):
        np.testing.assert_array_equal(raw.molecule(i)[0], qm9.molecule(j)[0])
        np.testing.assert_allclose(raw.molecule(i)[1], qm9.molecule(j)[1], atol=6e-5)


def test_raw_missing_files(tmp_path):
    (tmp_path / "gdb9.sdf").write_text("")
    with pytest.raises(StoreError, match=r"missing QM9 raw files \['gdb9.sdf.csv', 'unchar"):
        import_qm9_raw(tmp_path, tmp_path / "out.h5")
