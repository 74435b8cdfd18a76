"""MoleculeStore and write_store: round trip, atomic writes, bad input, laziness, pickling."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest

from schnet_ipu.data import MoleculeStore, StoreError, import_qm9, write_store
from schnet_ipu.data import store as store_module


def small_molecules(rng: np.random.Generator, count: int = 5):
    sizes = rng.integers(1, 8, size=count)
    z = [rng.integers(1, 10, size=n) for n in sizes]
    pos = [rng.normal(size=(n, 3)) for n in sizes]
    return z, pos


@pytest.fixture(scope="module")
def qm9_store(tmp_path_factory) -> Path:
    return import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=300, progress=False)


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    z, pos = small_molecules(rng)
    energy = rng.normal(size=5)
    ref = np.zeros(119)
    ref[1] = -0.5
    path = write_store(
        tmp_path / "s.h5",
        z,
        pos,
        targets={"energy": energy, "dipole": np.arange(5.0)},
        units={"energy": "eV", "dipole": "D"},
        ids=[10, 11, 12, 13, 14],
        attrs={"source": "test", "source_version": "0"},
        atomrefs={"energy": ref},
    )
    store = MoleculeStore(path)
    assert len(store) == 5
    assert store.target_names == ["energy", "dipole"]
    assert store.unit("dipole") == "D"
    np.testing.assert_array_equal(store.num_atoms, [len(m) for m in z])
    np.testing.assert_array_equal(store.ids, [10, 11, 12, 13, 14])
    np.testing.assert_array_equal(store.target("energy"), energy)
    np.testing.assert_array_equal(store.atomref("energy"), ref)
    assert store.atomref("dipole") is None
    for i in range(5):
        mz, mpos = store.molecule(i)
        assert mz.dtype == np.uint8 and mpos.dtype == np.float32
        np.testing.assert_array_equal(mz, z[i])
        np.testing.assert_allclose(mpos, pos[i], rtol=1e-6, atol=1e-6)
    assert store.attrs["schema_version"] == 1  # version 2 only with partial-label masks
    assert store.attrs["source"] == "test" and store.attrs["synthetic"] is False
    assert store.attrs["num_atoms"] == sum(len(m) for m in z)
    assert [p.name for p in tmp_path.iterdir()] == ["s.h5"]  # no temp file left behind


def test_concatenated_input_and_symbols(tmp_path):
    path = write_store(
        tmp_path / "s.h5",
        np.array(["O", "H", "H", "C"]),
        np.zeros((4, 3)) + np.arange(4)[:, None],
        targets={"y": [1.0, 2.0]},
        units={"y": "eV"},
        offsets=[0, 3, 4],
    )
    store = MoleculeStore(path)
    np.testing.assert_array_equal(store.molecule(0)[0], [8, 1, 1])
    np.testing.assert_array_equal(store.molecule(1)[0], [6])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("nan", "record 12 (molecule 2) has non-finite"),
        ("element", "record 11 (molecule 1) has an unknown element symbol 'Xx'"),
        ("empty", "record 13 (molecule 3) has no atoms"),
    ],
)
def test_bad_input_names_record_and_writes_nothing(tmp_path, change, message):
    z = [["C", "H"], ["O", "H"], ["N"], ["F"]]
    pos = [np.zeros((2, 3)), np.ones((2, 3)), np.full((1, 3), 2.0), np.full((1, 3), 3.0)]
    if change == "nan":
        pos[2][0, 1] = np.nan
    elif change == "element":
        z[1][0] = "Xx"
    else:
        z[3], pos[3] = [], np.zeros((0, 3))
    with pytest.raises(StoreError) as err:
        write_store(
            tmp_path / "bad.h5",
            z,
            pos,
            targets={"y": np.zeros(4)},
            units={"y": "eV"},
            ids=[10, 11, 12, 13],
            origin="fixture.csv",
        )
    assert "fixture.csv" in str(err.value) and message in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_unknown_target_lists_names(qm9_store):
    store = MoleculeStore(qm9_store)
    with pytest.raises(StoreError, match=r"no target 'U00'; targets: mu, alpha, .*U0, U, H, G"):
        store.target("U00")
    with pytest.raises(StoreError, match=str(qm9_store)):
        store.unit("nope")


def test_missing_file(tmp_path):
    with pytest.raises(StoreError, match=r"missing\.h5: store file not found"):
        MoleculeStore(tmp_path / "missing.h5")


def test_truncated_and_corrupt_files(qm9_store, tmp_path):
    data = qm9_store.read_bytes()
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError, match=r"truncated\.h5: unreadable store"):
        MoleculeStore(truncated)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"this is not hdf5" * 100)
    with pytest.raises(StoreError, match=r"garbage\.h5: unreadable store"):
        MoleculeStore(garbage)


def test_foreign_and_other_version(tmp_path, qm9_store):
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(StoreError, match=r"foreign\.h5: not a schnet-ipu molecule store"):
        MoleculeStore(foreign)
    other = tmp_path / "v3.h5"
    other.write_bytes(qm9_store.read_bytes())
    with h5py.File(other, "r+") as f:
        f.attrs["schema_version"] = 3
    with pytest.raises(StoreError, match=r"v3\.h5: written with store schema version 3"):
        MoleculeStore(other)


def test_lazy_open_and_cache(qm9_store):
    store = MoleculeStore(qm9_store)
    assert store._handle is None  # validation closed its handle; nothing open yet
    first = store.molecule(7)
    assert store._handle is not None
    assert (store.cache_hits, store.cache_misses) == (0, 1)
    again = store.molecule(7)
    assert again[0] is first[0]
    assert (store.cache_hits, store.cache_misses) == (1, 1)
    uncached = MoleculeStore(qm9_store, cache=False)
    uncached.molecule(7)
    uncached.molecule(7)
    assert (uncached.cache_hits, uncached.cache_misses) == (0, 2)
    # the miss cached the whole chunk: its neighbours are hits, with the same atoms
    for i in (6, 8):
        for cached, read in zip(store.molecule(i), uncached.molecule(i), strict=True):
            np.testing.assert_array_equal(cached, read)
    assert (store.cache_hits, store.cache_misses) == (3, 1)


def test_block_cache_covers_every_molecule(qm9_store):
    """Reading all molecules in a shuffled order through chunk blocks gives exactly the
    uncached molecules, with far fewer file reads than molecules."""
    store, uncached = MoleculeStore(qm9_store), MoleculeStore(qm9_store, cache=False)
    for i in np.random.default_rng(0).permutation(len(store)).tolist():
        z, pos = store.molecule(i)
        z_ref, pos_ref = uncached.molecule(i)
        np.testing.assert_array_equal(z, z_ref)
        np.testing.assert_array_equal(pos, pos_ref)
    assert store.cache_misses < len(store) / 4
    with pytest.raises(IndexError):
        store.molecule(len(store))


def test_pickle_for_workers(qm9_store):
    store = MoleculeStore(qm9_store)
    store.molecule(3)
    clone = pickle.loads(pickle.dumps(store))
    assert clone._handle is None and clone.cache_misses == 0 and not clone._cache
    np.testing.assert_array_equal(clone.molecule(3)[1], store.molecule(3)[1])
    np.testing.assert_array_equal(clone.target("U0"), store.target("U0"))


def test_reopens_after_fork(qm9_store):
    store = MoleculeStore(qm9_store, cache=False)
    store.molecule(0)
    parent_handle = store._handle
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's handle
        ok = store.molecule(5)[0].tolist() == MoleculeStore(qm9_store).molecule(5)[0].tolist()
        os.write(write, b"1" if ok and store._handle is not parent_handle else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


class Interrupt:
    """An attribute value that stops the writer while it converts it (after the datasets)."""

    def __init__(self, hard: bool) -> None:
        self.hard = hard

    def __array__(self, *args, **kwargs):
        if self.hard:
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyboardInterrupt


def write_interrupted(out: Path, hard: bool) -> None:
    rng = np.random.default_rng(0)
    z, pos = small_molecules(rng, count=50)
    write_store(out, z, pos, {"y": np.zeros(50)}, {"y": "eV"}, attrs={"stop": Interrupt(hard)})


def test_interrupted_write_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        write_interrupted(tmp_path / "s.h5", hard=False)
    assert list(tmp_path.iterdir()) == []


def test_killed_write_leaves_no_store(tmp_path):
    out = tmp_path / "s.h5"
    pid = os.fork()
    if pid == 0:
        try:
            write_interrupted(out, hard=True)
        finally:
            os._exit(1)  # only reached when the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not out.exists()
    (leftover,) = tmp_path.iterdir()  # the half-written temp file, never mistaken for a store
    assert leftover.name.startswith(".s.h5.tmp")


@pytest.mark.parametrize("window", [50, 1 << 24])  # many read windows, or one
@pytest.mark.parametrize("pick", ["random", "blocks", "all"])
def test_atoms_of_some_molecules_are_their_rows(qm9_store, monkeypatch, window, pick):
    """``atoms_of`` reads only the molecules asked for (in windows of READ_SLICE atoms; a
    window with gaps is one span, then picked) and gives exactly their rows."""
    monkeypatch.setattr(store_module, "READ_SLICE", window)
    store = MoleculeStore(qm9_store)
    rng = np.random.default_rng(4)
    molecules = {
        "random": np.sort(rng.choice(len(store), 37, replace=False)),
        "blocks": np.r_[3:40, 120:121, 200:260],
        "all": np.arange(len(store)),
    }[pick]
    z, pos, offsets = store.atoms_of(molecules)
    all_z, all_pos = store.concatenated()
    rows = np.concatenate([np.arange(store.offsets[m], store.offsets[m + 1]) for m in molecules])
    np.testing.assert_array_equal(z, all_z[rows])
    np.testing.assert_array_equal(pos, all_pos[rows])
    np.testing.assert_array_equal(np.diff(offsets), store.num_atoms[molecules])


def test_atoms_of_names_a_damaged_record_by_its_store_index(tmp_path):
    rng = np.random.default_rng(0)
    z, pos = small_molecules(rng, count=6)
    path = write_store(tmp_path / "s.h5", z, pos, {"e": np.zeros(6)}, {"e": "eV"})
    store = MoleculeStore(path)
    with h5py.File(path, "r+") as f:  # damaged after import: molecule 4's first coordinate
        f["pos"][store.offsets[4], 0] = np.nan
    with pytest.raises(StoreError, match=r"molecule 4 \(record"):
        MoleculeStore(path).atoms_of(np.array([1, 4, 5]))
    MoleculeStore(path).atoms_of(np.array([0, 1, 5]))  # the others read fine
