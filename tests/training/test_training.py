"""The training application end to end on a small real QM9 slice and a tiny SchNet."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from schnet_ipu.config import ConfigError, load_config
from schnet_ipu.training.finished_runs import evaluate_ensemble, evaluate_run, predict_split
from schnet_ipu.training.log import read_records
from schnet_ipu.training.loop import TrainingError, train
from tests.helpers import ROOT, TRAIN_PY, qm9_smoke_overrides, run_train, wait_for


def tiny(qm9_small: Path, run_dir: Path, *extra: str) -> list[str]:
    return qm9_smoke_overrides(
        qm9_small,
        run_dir,
        "data.subset=0",  # over configs/qm9_quickstart.yaml's 16000
        "model.k=8",
        "optim.epochs=2",
        "backend.threads=0",  # torch's default: these runs keep the session's thread count
        "logging.plot=true",
        *extra,
    )


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints/last.pt", weights_only=False)["model"]


def test_run_directory_contract(qm9_small, tmp_path):
    run_dir = tmp_path / "run"
    one = ["backend.replicas=1", "backend.compile=false"]  # the contract of one process
    final = train(
        load_config(ROOT / "configs/qm9_quickstart.yaml", [*tiny(qm9_small, run_dir), *one])
    )
    records = read_records(run_dir / "metrics.jsonl")
    kinds = [r["kind"] for r in records]
    assert kinds.count("epoch") == 2 and kinds.count("final") == 1 and "step" in kinds
    for r in read_records(run_dir / "metrics.jsonl", "epoch"):
        assert {"epoch", "train_loss", "val_mae", "molecules_per_s"} <= set(r)
        assert r["molecules_per_s"] > 0 and r["val_mae"] > 0
    step = read_records(run_dir / "metrics.jsonl", "step")[0]
    assert step["replicas"] == 1 and step["collectives_per_step"] == 0
    assert final["unit"] == "eV" and final["test_molecules"] == 60
    assert final["cuda_graph_captures"] == 0  # backend.cuda_graphs=auto is off on a CPU
    for key in ("test_mae", "test_rmse", "baseline_test_mae", "wall_seconds"):
        assert final[key] > 0
    assert final["test_rmse"] >= final["test_mae"]
    assert (run_dir / "config.yaml").exists() and (run_dir / "learning_curve.png").exists()
    assert (run_dir / "checkpoints/best.pt").exists()

    evaluated = evaluate_run(run_dir, "test")
    assert evaluated["mae"] == pytest.approx(final["test_mae"], rel=1e-5)
    out = tmp_path / "pred.csv"
    assert predict_split(run_dir, "test", out) == 60
    rows = list(csv.DictReader(out.open()))
    errors = [float(r["prediction"]) - float(r["target"]) for r in rows]
    assert [float(r["error"]) for r in rows] == pytest.approx(errors, abs=2e-6)
    mae = sum(abs(e) for e in errors) / len(errors)
    assert mae == pytest.approx(final["test_mae"], rel=1e-3)
    # the CSV holds the store's own target (U0, about -400 eV), not the shifted one
    assert all(float(r["target"]) < -40 for r in rows)


def predicted_by_index(csv_path: Path) -> dict[int, tuple[float, float]]:
    return {
        int(r["index"]): (float(r["prediction"]), float(r["target"]))
        for r in csv.DictReader(csv_path.open())
    }


def test_an_ensemble_of_two_seeds_on_one_split_is_the_mean_of_its_members(qm9_small, tmp_path):
    """Members trained with seeds 0 and 1 and one ``data.split_seed`` share their test split;
    ``train.py evaluate --run A --run B`` scores the mean of their energies. A run whose split came
    from its own seed is refused (it trained on some of the others' test molecules), and so is
    one that predicts another target."""
    members = [tmp_path / "seed0", tmp_path / "seed1"]
    for seed, run_dir in enumerate(members):
        train(load_config(None, tiny(qm9_small, run_dir, f"seed={seed}", "data.split_seed=5")))
    command = run_train("evaluate", *(f"--run={r}" for r in members))
    assert command.returncode == 0, command.stderr
    result = json.loads(command.stdout)
    assert result == evaluate_ensemble(members, "test")

    each = []
    for run_dir in members:
        out = tmp_path / f"{run_dir.name}.csv"
        predict_split(run_dir, "test", out)
        each.append(predicted_by_index(out))
    assert each[0].keys() == each[1].keys() and len(each[0]) == result["molecules"] == 60
    mean_errors = [abs((each[0][i][0] + each[1][i][0]) / 2 - each[0][i][1]) for i in each[0]]
    assert result["mae"] == pytest.approx(sum(mean_errors) / len(mean_errors), abs=2e-6)
    for run_dir, member_mae in zip(members, result["member_mae"]):
        assert member_mae == pytest.approx(evaluate_run(run_dir, "test")["mae"], rel=1e-6)
    assert result["mae"] not in result["member_mae"]  # two different models were averaged

    own_split = tmp_path / "own_split"
    train(load_config(None, tiny(qm9_small, own_split, "seed=1")))
    with pytest.raises(ConfigError, match="own_split's test split differs"):
        evaluate_ensemble([members[0], own_split], "test")
    other_target = tmp_path / "enthalpy"
    train(load_config(None, tiny(qm9_small, other_target, "data.split_seed=5", "data.target=H")))
    with pytest.raises(ConfigError, match=r"enthalpy predicts H of .* share one target"):
        evaluate_ensemble([members[0], other_target], "test")


def interrupt_after_first_step(
    command: list[str],
    run_dir: Path,
    interrupt: Callable[[subprocess.Popen], None] = lambda p: p.send_signal(signal.SIGINT),
) -> str:
    """Run ``command`` (``train.py`` into ``run_dir``) in a process group of its own until its
    first step record, ``interrupt`` it (default: SIGINT to the launcher), check it exits 130
    and return its stderr. Whatever fails (a replica left waiting on the other included),
    nothing it started is left running."""
    process = subprocess.Popen(
        command, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_for(lambda: read_records(metrics, "step"), [process], "a step record", timeout_s=120)
        interrupt(process)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr
    return stderr


def test_ctrl_c_checkpoints_and_resume_matches_an_uninterrupted_run(qm9_small, tmp_path):
    overrides = tiny(qm9_small, tmp_path / "whole", "optim.epochs=3")
    train(load_config(None, overrides))
    reference = weights(tmp_path / "whole")

    interrupted = tmp_path / "interrupted"
    command = [*TRAIN_PY, *tiny(qm9_small, interrupted, "optim.epochs=3")]
    interrupt_after_first_step(command, interrupted)
    metrics = interrupted / "metrics.jsonl"
    saved = torch.load(interrupted / "checkpoints/last.pt", weights_only=False)
    assert (saved["epoch"], saved["call"]) < (3, 0)

    train(load_config(None, tiny(qm9_small, interrupted, "optim.epochs=3")))  # resumes
    resumed = weights(interrupted)
    for name, value in reference.items():
        assert torch.allclose(resumed[name], value, rtol=0, atol=1e-6), name
    epochs = [r["epoch"] for r in read_records(metrics, "epoch")]
    assert epochs == [0, 1, 2]
    # every step record once, the one of the call the checkpoint was taken at included
    whole = read_records(tmp_path / "whole/metrics.jsonl", "step")
    assert [r["step"] for r in read_records(metrics, "step")] == [r["step"] for r in whole]


def spawned_replicas(launcher: int) -> list[int]:
    """Process ids of the replicas a launcher spawned (multiprocessing's spawn children;
    not its resource tracker), read from /proc."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    found = []
    for pid in map(int, children):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in command:
            found.append(pid)
    return found


TWO_REPLICAS = ("optim.epochs=3", "backend.replicas=2")


@pytest.fixture(scope="module")
def two_replicas_uninterrupted(qm9_small, tmp_path_factory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    train(load_config(None, tiny(qm9_small, run_dir, *TWO_REPLICAS)))
    return weights(run_dir)


@pytest.mark.parametrize("reaches", ["the terminal's group", "the launcher", "one replica"])
def test_ctrl_c_stops_two_replicas_at_one_call_and_resume_matches(
    qm9_small, tmp_path, two_replicas_uninterrupted, reaches
):
    """A terminal's Ctrl-C reaches the launcher and both replicas (one process group); a
    ``kill -INT`` may reach the launcher alone (it passes it on) or one replica alone. The
    replicas see it at different host calls, so they agree on it first and stop at the
    same one: the run exits 130 with no traceback, ``last.pt`` holds that call, and the
    same command resumes to the weights of an uninterrupted run."""
    interrupted = tmp_path / "interrupted"
    command = [*TRAIN_PY, *tiny(qm9_small, interrupted, *TWO_REPLICAS)]

    def interrupt(launcher: subprocess.Popen) -> None:
        if reaches == "the terminal's group":
            os.killpg(launcher.pid, signal.SIGINT)
        elif reaches == "the launcher":
            launcher.send_signal(signal.SIGINT)
        else:
            os.kill(max(spawned_replicas(launcher.pid)), signal.SIGINT)

    stderr = interrupt_after_first_step(command, interrupted, interrupt)
    assert "Traceback" not in stderr and "re-run to resume" in stderr, stderr
    assert "leaked" not in stderr, stderr  # the resource tracker cleaned up after a replica
    saved = torch.load(interrupted / "checkpoints/last.pt", weights_only=False)
    assert (saved["epoch"], saved["call"]) < (3, 0)

    train(load_config(None, tiny(qm9_small, interrupted, *TWO_REPLICAS)))  # resumes
    resumed = weights(interrupted)
    for name, value in two_replicas_uninterrupted.items():
        assert torch.allclose(resumed[name], value, rtol=0, atol=1e-6), name
    assert [r["epoch"] for r in read_records(interrupted / "metrics.jsonl", "epoch")] == [0, 1, 2]


def test_a_stopped_replicated_run_finishes_its_wandb_run_and_the_resume_continues_it(
    qm9_small, tmp_path
):
    """wandb (offline) with two replicas: a Ctrl-C finishes rank 0's wandb run before the
    replica leaves by ``os._exit`` (wandb prints how to sync it only from ``finish``), and
    the resumed run logs to the same wandb run id, not a new one."""
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    command = [*TRAIN_PY, *tiny(qm9_small, run_dir, *TWO_REPLICAS, "logging.wandb_mode=offline")]
    stderr = interrupt_after_first_step(command, run_dir)
    assert "wandb sync" in stderr, stderr  # the summary wandb.finish prints

    resumed = subprocess.run(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    sittings = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(sittings) == 2 and all(d.name.endswith(f"-{run_id}") for d in sittings), sittings


def test_ctrl_c_during_validation_finishes_the_epoch_then_stops(qm9_small, tmp_path, monkeypatch):
    """Ctrl-C outside the training loop (here: in validation) is a stop request too: the
    epoch ends with its record and checkpoint, the run exits 130 without a traceback, and a
    re-run resumes to the weights of an uninterrupted run."""
    train(load_config(None, tiny(qm9_small, tmp_path / "whole", "optim.epochs=2")))
    reference = weights(tmp_path / "whole")

    from schnet_ipu.training import loop as training

    evaluate = training.evaluate

    def interrupted_once(task, backend, loader, split, world_size):
        if split == "val" and not getattr(interrupted_once, "done", False):
            interrupted_once.done = True
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C typed during validation
        return evaluate(task, backend, loader, split, world_size)

    run_dir = tmp_path / "interrupted"
    monkeypatch.setattr(training, "evaluate", interrupted_once)
    try:  # a KeyboardInterrupt escaping the run would be the bug: catch it to fail cleanly
        train(load_config(None, tiny(qm9_small, run_dir, "optim.epochs=2")))
        stopped = None
    except BaseException as err:
        stopped = err
    assert isinstance(stopped, SystemExit) and stopped.code == 130, repr(stopped)
    saved = torch.load(run_dir / "checkpoints/last.pt", weights_only=False)
    assert (saved["epoch"], saved["call"]) == (1, 0)  # the first epoch, whole
    assert [r["epoch"] for r in read_records(run_dir / "metrics.jsonl", "epoch")] == [0]

    monkeypatch.setattr(training, "evaluate", evaluate)
    train(load_config(None, tiny(qm9_small, run_dir, "optim.epochs=2")))  # resumes
    for name, value in reference.items():
        assert torch.allclose(weights(run_dir)[name], value, rtol=0, atol=1e-6), name


def test_another_configs_run_directory_is_refused(qm9_small, tmp_path):
    run_dir = tmp_path / "run"
    train(load_config(None, tiny(qm9_small, run_dir, "optim.epochs=1")))
    with pytest.raises(ConfigError, match=r"another config \(model\.hidden_channels: 16"):
        train(load_config(None, tiny(qm9_small, run_dir, "model.hidden_channels=32")))
    # --fresh discards it
    train(
        load_config(None, tiny(qm9_small, run_dir, "model.hidden_channels=32", "optim.epochs=1")),
        fresh=True,
    )


def test_a_run_saved_before_new_config_keys_resumes(qm9_small, tmp_path):
    run_dir = tmp_path / "run"
    train(load_config(None, tiny(qm9_small, run_dir, "optim.epochs=1")))
    last = run_dir / "checkpoints/last.pt"
    saved = torch.load(last, weights_only=False)
    for key in [k for k in saved["config"]["optim"] if k.startswith("spike_")]:
        del saved["config"]["optim"][key]  # as saved before the divergence guard existed
    del saved["guard"]
    torch.save(saved, last)
    train(load_config(None, tiny(qm9_small, run_dir, "optim.epochs=2")))  # resumes, not refused
    assert [r["epoch"] for r in read_records(run_dir / "metrics.jsonl", "epoch")] == [0, 1]


def test_non_finite_loss_stops_and_names_the_step(qm9_small, tmp_path):
    run_dir = tmp_path / "run"
    guard_off = "optim.spike_guard=false"  # with it, tests/training/test_guard.py
    cfg = load_config(
        None, tiny(qm9_small, run_dir, "optim.lr=1e12", "optim.grad_clip=0", guard_off)
    )
    with pytest.raises(TrainingError, match=r"non-finite loss .* at epoch 0, step \d+"):
        train(cfg)
    assert not (run_dir / "checkpoints/last.pt").exists()


def test_losses_read_every_log_every_calls_equal_the_per_step_losses(qm9_small, tmp_path):
    """Losses stay on the device between reads; reading every 3 calls (and at the epoch end)
    gives the same step and epoch losses as reading after every call."""
    runs = {}
    for every in (1, 3):
        run_dir = tmp_path / f"every{every}"
        overrides = tiny(qm9_small, run_dir, "optim.epochs=1", f"logging.log_every={every}")
        train(load_config(None, overrides))
        runs[every] = read_records(run_dir / "metrics.jsonl")
    each = {r["call"]: r["loss"] for r in runs[1] if r["kind"] == "step"}
    sparse = {r["call"]: r["loss"] for r in runs[3] if r["kind"] == "step"}
    assert sparse and set(sparse) == {call for call in each if call % 3 == 0}
    assert all(loss == each[call] for call, loss in sparse.items())
    (epoch_each,) = [r["train_loss"] for r in runs[1] if r["kind"] == "epoch"]
    (epoch_sparse,) = [r["train_loss"] for r in runs[3] if r["kind"] == "epoch"]
    assert epoch_sparse == epoch_each


def test_data_aware_config_errors(qm9_small, tmp_path):
    with pytest.raises(ConfigError, match=r"max_nodes"):
        train(
            load_config(None, tiny(qm9_small, tmp_path / "a", "packing.max_nodes=10", "model.k=4"))
        )
    with pytest.raises(ConfigError, match=r"lower backend\.replicas"):
        train(
            load_config(None, tiny(qm9_small, tmp_path / "b", "backend.gradient_accumulation=500"))
        )


def test_two_replicas_train_with_one_merged_allreduce(qm9_small, tmp_path):
    run_dir = tmp_path / "run"
    final = train(
        load_config(None, tiny(qm9_small, run_dir, "optim.epochs=1", "backend.replicas=2"))
    )
    step = read_records(run_dir / "metrics.jsonl", "step")[0]
    assert step["replicas"] == 2 and step["collectives_per_step"] == 1
    assert final["test_molecules"] == 60  # both replicas' shares, each molecule once


def test_an_error_found_in_a_replica_ends_on_its_one_line(qm9_small, tmp_path):
    """A user error that a replica finds (here the split against the store) ends the run
    on its one line, exit 2, without torch's note that it terminated the other replica."""
    bad_split = ("backend.replicas=2", "data.val=300", "data.test=300")
    result = run_train(*tiny(qm9_small, tmp_path / "run", *bad_split))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: val=300")
    assert "Terminating process" not in result.stderr


def test_ipu_model_emulates_four_replicas_in_one_process(qm9_small, tmp_path):
    """backend.device=ipu-model without PopTorch: one process feeds 4 replicas per call."""
    run_dir = tmp_path / "run"
    overrides = tiny(qm9_small, run_dir, "optim.epochs=1", "backend.device=ipu-model")
    final = train(load_config(None, [*overrides, "backend.replicas=4"]))
    step = read_records(run_dir / "metrics.jsonl", "step")[0]
    assert step["replicas"] == 4 and step["collectives_per_step"] == 1
    assert final["test_molecules"] == 60


def test_cli_prints_config_and_rejects_unknown_keys():
    run = [*TRAIN_PY, "--config", "configs/qm9.yaml"]
    shown = subprocess.run(
        [*run, "--print-config", "optim.lr=5e-4"], cwd=ROOT, capture_output=True, text=True
    )
    assert shown.returncode == 0 and "lr: 0.0005" in shown.stdout
    bad = subprocess.run(
        [*run, "optim.lrr=1"], cwd=ROOT, capture_output=True, text=True, env={**os.environ}
    )
    assert bad.returncode == 2 and "did you mean optim.lr" in bad.stderr
