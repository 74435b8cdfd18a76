"""Shared fixtures: real QM9 rows, imported from the qm9pack package (no file needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from schnet_ipu.data import compiled_pairs, import_qm9
from schnet_ipu.feed import compiled as compiled_feed


def pytest_configure(config) -> None:
    """Without a GPU, Triton kernels can only run under Triton's interpreter; it must be on
    before anything imports triton (its own library functions are decorated then), so the
    opt-in ``triton`` tests set it here, at the start of the session."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def qm9_store(tmp_path_factory) -> Path:
    """A store of the first 2,000 real QM9 molecules (imported once per test session)."""
    return import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=2000, progress=False)


@pytest.fixture(scope="session")
def qm9_small(tmp_path_factory) -> Path:
    """A store of the first 400 real QM9 molecules: the smoke runs' data (imported once)."""
    return import_qm9(tmp_path_factory.mktemp("qm9") / "qm9_400.h5", limit=400, progress=False)


@pytest.fixture(scope="module")
def restore_threads():
    """Put torch's intra-op thread count back after a module whose runs change it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["compiled", "torch"])
def feed_program(request, monkeypatch) -> str:
    """Run a test on both ways the CPU feed is computed: numba's compiled loops, and the
    torch programs (which also run on a GPU for device-resident data, and without numba)."""
    if request.param == "compiled" and not compiled_feed.AVAILABLE:
        pytest.skip("numba is not installed (requirements.txt): no compiled loops")
    for loops in (compiled_feed, compiled_pairs):  # the feed's batches, the pairs file's search
        monkeypatch.setattr(loops, "AVAILABLE", request.param == "compiled")
    return request.param
