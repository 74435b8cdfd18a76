"""The global batch and the learning rate across replicas (and hosts): a step averages the
gradients of every replica's micro-batches, so with R replicas it holds R times the packs
of one, an epoch has R times fewer steps, and ``optim.lr`` stays per step (not scaled).
The resolved config says so; under torchrun ``backend.replicas`` must be the world size."""

from __future__ import annotations

import math
import subprocess

import pytest
import yaml

from schnet_ipu.backends.distributed import init_replica
from schnet_ipu.config import BackendConfig, ConfigError, config_from_dict, load_config
from schnet_ipu.training.data import make_loader, prepare_data
from tests.helpers import ROOT, TRAIN_PY, qm9_smoke_overrides


def test_the_resolved_config_ends_with_its_global_batch():
    shown = subprocess.run(
        [*TRAIN_PY, "--print-config", "backend.replicas=4", "backend.gradient_accumulation=2",
         "packing.packs_per_batch=3", "optim.lr=5e-4"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1] == (
        "# global batch: backend.replicas 4 x backend.gradient_accumulation 2 x "
        "packing.packs_per_batch 3 = 24 packs per optimiser step; optim.lr 0.0005 is per "
        "step, not scaled with the replicas"
    )
    again = config_from_dict(yaml.safe_load(shown.stdout))  # still a config, read back
    assert again.backend.replicas == 4 and again.optim.lr == 5e-4


def steps_of(loaders) -> list[tuple[list[int], int]]:
    """Each optimiser step of epoch 0 over all replicas: the store indices it trains on, and
    how many packs hold any of them."""
    calls = [list(loader.epoch(0)) for loader in loaders]
    steps = []
    for step in zip(*calls, strict=True):  # every replica runs the same host calls
        batches = [batch for call in step for batch in call]
        molecules = [i for b in batches for i in b.molecule_index[b.graph_mask].tolist()]
        B = loaders[0].dataset.layout.packs_per_batch
        packs = sum(int(b.graph_mask.view(B, -1).any(1).sum()) for b in batches)
        steps.append((sorted(molecules), packs))
    return steps


@pytest.mark.parametrize("shard", [False, True])
def test_steps_hold_the_packs_of_every_replica(qm9_small, tmp_path, shard):
    overrides = qm9_smoke_overrides(
        qm9_small, tmp_path / "run", "backend.gradient_accumulation=2",
        f"loader.shard={str(shard).lower()}",
    )  # fmt: skip
    cfg = load_config(None, overrides)
    data = prepare_data(cfg)
    packs, per_replica = data.train_plan.num_packs, 2 * cfg.packing.packs_per_batch
    one = steps_of([make_loader(cfg, data, "train", 0, 1)])
    assert len(one) == math.ceil(packs / per_replica)
    for replicas in (2, 4):
        loaders = []
        for replica in range(replicas):
            data = prepare_data(cfg)  # a process of its own (a replica's share)
            loaders.append(make_loader(cfg, data, "train", replica, replicas))
        steps = steps_of(loaders)
        # every step holds R x A x B packs, until the epoch (or a replica's share) runs out
        smallest = packs // replicas if shard else packs / replicas
        full = math.floor(smallest / per_replica)
        assert [n for _, n in steps[:full]] == [replicas * per_replica] * full
        assert len(steps) == math.ceil(math.ceil(packs / replicas) / per_replica)
        if not shard:  # the packs of R consecutive steps of one replica
            for k, (molecules, _) in enumerate(steps):
                group = one[k * replicas : (k + 1) * replicas]
                assert molecules == sorted(i for step, _ in group for i in step)
        every = sorted(i for step, _ in steps for i in step)
        assert every == sorted(data.split["train"].tolist())  # the epoch, once


def test_replicas_other_than_the_launchers_world_size_are_refused(monkeypatch):
    """torchrun started 4 processes over the nodes, the config says 2: one line, before any
    process group (the global batch would silently be twice the configured one)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"backend.replicas=2, but the launcher started 4 "):
        init_replica(BackendConfig(device="cpu", replicas=2), "cpu")
