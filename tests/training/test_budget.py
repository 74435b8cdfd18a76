"""Training for a wall-clock budget (optim.max_minutes) and with an average of the weights
(optim.ema_decay): where runs stop, what resumes, which weights are evaluated and saved."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from schnet_ipu.checkpoint import load_model_state
from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.model import SchNet
from schnet_ipu.training import loop as training
from schnet_ipu.training.budget import Budget, WeightAverage
from schnet_ipu.training.finished_runs import evaluate_run
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import train
from schnet_ipu.training.setup import make_optimizer, make_scheduler, peak_lr
from tests.helpers import Killed, kill_after_first_checkpoint, qm9_rows, smoke_overrides

pytestmark = pytest.mark.usefixtures("restore_threads")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return qm9_rows(tmp_path_factory.mktemp("qm9"), limit=300)


def tiny(store: Path, run_dir: Path, *extra: str):
    return load_config(
        None,
        smoke_overrides(
            store,
            run_dir,
            "data.val=40",
            "data.test=40",
            "optim.schedule=cosine",
            *extra,
            width=16,
        ),
    )


def test_budget_stops_the_run_and_a_resume_keeps_the_total(store, tmp_path, monkeypatch):
    """A 6 s budget with 10,000 epochs allowed: the run stops once 6 s of training loop are
    counted, validates, saves and tests. Killed after its first checkpoint and re-run, the
    run ends at the same counted total, every epoch record once."""
    budget = 0.1  # minutes
    whole = train(
        tiny(store, tmp_path / "whole", f"optim.max_minutes={budget}", "optim.epochs=10000")
    )
    epochs = read_records(tmp_path / "whole/metrics.jsonl", "epoch")
    assert 1 <= len(epochs) < 10000
    assert 60 * budget <= whole["budget_seconds"] < 60 * budget + 5  # + one call and validation
    assert epochs[-1]["epoch_fraction"] <= 1 and whole["test_molecules"] == 40
    lrs = [r["lr"] for r in epochs]
    assert len(lrs) >= 2 and lrs[-1] < 0.5 * lrs[0]  # the cosine follows the budget's time

    run_dir = tmp_path / "killed"
    kill_after_first_checkpoint(monkeypatch)
    with pytest.raises(Killed):
        train(tiny(store, run_dir, f"optim.max_minutes={budget}", "optim.epochs=10000"))
    spent = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["budget_seconds"]
    assert 0 < spent < 60 * budget
    resumed = train(tiny(store, run_dir, f"optim.max_minutes={budget}", "optim.epochs=10000"))
    assert 60 * budget <= resumed["budget_seconds"] < 60 * budget + 5
    records = read_records(run_dir / "metrics.jsonl", "epoch")
    seconds = [r["budget_seconds"] for r in records]  # every validation recorded once
    assert seconds == sorted(set(seconds)) and records[0]["epoch"] == 0


def test_a_spent_budget_stays_spent_when_its_checkpoint_was_slow(store, tmp_path, monkeypatch):
    """The count a checkpoint records is the one the loop stops on: a first checkpoint
    write that outlasts the whole 3 s budget neither ends the run early nor leaves a
    ``last.pt`` that says budget is left, and the same command again trains nothing."""
    save = training.save_checkpoint

    def slow_first_save(path, state):
        time.sleep(3.5)  # longer than the budget: not training, so not counted
        save(path, state)
        monkeypatch.setattr(training, "save_checkpoint", save)  # the others at full speed

    monkeypatch.setattr(training, "save_checkpoint", slow_first_save)
    run_dir, budget = tmp_path / "run", 0.05  # minutes
    args = (f"optim.max_minutes={budget}", "optim.epochs=10000", "logging.log_every=1")
    first = train(tiny(store, run_dir, *args))
    spent = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["budget_seconds"]
    assert spent >= 60 * budget and first["budget_seconds"] == spent
    steps = read_records(run_dir / "metrics.jsonl", "step")
    assert len(read_records(run_dir / "metrics.jsonl", "epoch")) > 1  # it went on after the write
    train(tiny(store, run_dir, *args))
    assert read_records(run_dir / "metrics.jsonl", "step") == steps


def test_a_budget_validates_within_epochs_that_outlast_a_tenth_of_it(store, tmp_path, monkeypatch):
    """A wide model on 220 molecules, one pack per step, for 6 s: an epoch (~2 s here) takes
    longer than a tenth of the budget, so the loop pauses to validate inside epochs and goes
    on from there.
    Killed after its first checkpoint (inside an epoch) and re-run, no record is lost or
    written twice."""
    run_dir = tmp_path / "run"
    wide = ["model.hidden_channels=256", "model.num_filters=256", "model.num_interactions=6"]
    overrides = ("optim.max_minutes=0.1", "optim.epochs=10000", "packing.packs_per_batch=1", *wide)
    kill_after_first_checkpoint(monkeypatch)
    with pytest.raises(Killed):
        train(tiny(store, run_dir, *overrides))
    assert read_records(run_dir / "metrics.jsonl", "epoch")[0]["epoch_fraction"] < 1
    train(tiny(store, run_dir, *overrides))
    records = read_records(run_dir / "metrics.jsonl", "epoch")
    epochs = [r["epoch"] for r in records]
    assert len(records) >= 4 and epochs == sorted(epochs)
    assert len(set(epochs)) < len(epochs)  # an epoch validated more than once: a pause in it
    share: dict[int, float] = {}
    for record in records:
        share[record["epoch"]] = share.get(record["epoch"], 0) + record["epoch_fraction"]
    assert all(abs(share[e] - 1) < 1e-9 for e in sorted(share)[:-1])  # done epochs: whole
    assert 0 < share[epochs[-1]] <= 1  # the budget may end the last one


def _agree(rank: int, init: str, out: Path) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    budget = Budget(minutes=1, spent=10.0 * rank, world_size=2)  # rank 1 is 10 s further on
    budget.start()
    before = budget.seconds  # what the last agreement said: the spent seconds
    budget.agree()
    out.joinpath(f"{rank}.txt").write_text(f"{before} {budget.seconds}")
    torch.distributed.destroy_process_group()


def test_replicas_read_one_agreed_budget_clock(tmp_path):
    """Two gloo replicas whose clocks differ by 10 s both take the later one at an
    agreement, so they stop at the same call and follow the same learning rate."""
    torch.multiprocessing.spawn(_agree, args=(f"file://{tmp_path}/store", tmp_path), nprocs=2)
    (before0, after0), (before1, after1) = (
        map(float, (tmp_path / f"{rank}.txt").read_text().split()) for rank in (0, 1)
    )
    assert (before0, before1) == (0.0, 10.0)
    assert after0 == after1 and 10.0 <= after0 < 12.0


def test_average_of_the_weights_is_what_runs_evaluate_save_and_resume(store, tmp_path, monkeypatch):
    ema = "optim.ema_decay=0.9"
    final = train(tiny(store, tmp_path / "whole", ema, "optim.epochs=3"))
    saved = torch.load(tmp_path / "whole/checkpoints/last.pt", weights_only=True)
    assert saved["ema"]["updates"] > 0
    differ = [
        k
        for k in saved["train_model"]
        if not torch.equal(saved["model"][k], saved["train_model"][k])
    ]
    assert differ  # the model file holds the average, not the last weights
    # the final test ran on best.pt's (averaged) weights, as evaluate does
    assert evaluate_run(tmp_path / "whole", "test")["mae"] == pytest.approx(
        final["test_mae"], rel=1e-6
    )

    kill_after_first_checkpoint(monkeypatch)
    with pytest.raises(Killed):
        train(tiny(store, tmp_path / "resumed", ema, "optim.epochs=3"))
    train(tiny(store, tmp_path / "resumed", ema, "optim.epochs=3"))  # resumes after epoch 0
    again = torch.load(tmp_path / "resumed/checkpoints/last.pt", weights_only=True)
    for key in ("model", "train_model"):
        for name, value in saved[key].items():
            torch.testing.assert_close(again[key][name], value, rtol=0, atol=1e-6)
    assert again["ema"] == saved["ema"]


def test_average_follows_the_weights_from_the_start():
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, decay=0.999)
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update()  # d = min(0.999, 2 / 11): mostly the new weights
    expected = model.weight.detach() - 1.0 + (1 - 2 / 11) * 1.0
    torch.testing.assert_close(average.shadow["weight"], expected)
    with average.swapped_in():
        torch.testing.assert_close(model.weight.detach(), expected)
    torch.testing.assert_close(model.weight.detach(), expected - (1 - 2 / 11) + 1.0)


def test_a_model_file_averages_the_filter_networks_under_both_their_names():
    """PyG's SchNet lists each interaction's filter network twice (``mlp`` and ``conv.nn``,
    one module). The averaged state dict holds the average under both names, so a model
    loaded from it is the model validation measured; a file that holds the raw weights under
    the alias (written before) loads its averaged ones."""
    torch.manual_seed(0)
    model = SchNet(hidden_channels=8, num_filters=8, num_interactions=2, graph="radius")
    fresh = SchNet(hidden_channels=8, num_filters=8, num_interactions=2, graph="radius")
    average = WeightAverage(model, decay=0.5)
    with torch.no_grad():
        for step in range(3):  # the average lags the weights, which move on after it
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            if step < 2:
                average.update()
    state = average.averaged_state_dict()
    aliases = [k for k in state if ".conv.nn." in k]
    assert len(aliases) == 8
    for alias in aliases:
        torch.testing.assert_close(state[alias], state[alias.replace("conv.nn", "mlp")])
    load_model_state(fresh, state)
    with average.swapped_in():
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)

    raw = model.state_dict()
    old_file = {k: raw[k] if k in aliases else v for k, v in state.items()}
    load_model_state(fresh, old_file)
    for name, p in fresh.named_parameters():
        torch.testing.assert_close(p, average.shadow[name], rtol=0, atol=0, msg=name)


def test_ema_decay_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.ema_decay"):
        load_config(None, ["optim.ema_decay=1.0"])


@pytest.mark.parametrize(
    "reference, minutes, expected",
    [(0.0, 30.0, 4e-3), (10.0, 5.0, 4e-3), (10.0, 10.0, 4e-3), (10.0, 40.0, 2e-3)],
)
def test_the_peak_lr_follows_the_budget_beyond_its_reference(reference, minutes, expected):
    """configs/qm9.yaml: lr 4e-3 is best up to 10 minutes; longer budgets scale it by
    sqrt(10 / minutes), and the cosine starts from that peak and ends at min_lr."""
    cfg = load_config(
        None,
        [
            "optim.lr=4e-3",
            f"optim.lr_reference_minutes={reference}",
            f"optim.max_minutes={minutes}",
            "optim.schedule=cosine",
            "optim.min_lr=1e-4",
        ],
    )
    assert peak_lr(cfg.optim) == pytest.approx(expected)
    optimizer = make_optimizer(cfg, torch.nn.Linear(2, 1), "cpu")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    budget = Budget(minutes, spent=60.0 * minutes)  # a spent budget: the cosine's floor
    scheduler = make_scheduler(cfg, optimizer, steps_per_epoch=10, budget=budget)
    for _ in range(cfg.optim.warmup_steps + 1):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_adam_beta2_reaches_the_optimizer():
    cfg = load_config(None, ["optim.adam_beta2=0.99"])
    optimizer = make_optimizer(cfg, torch.nn.Linear(2, 1), "cpu")
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
