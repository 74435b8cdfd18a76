"""Each benchmark suite runs on a tiny configuration and writes a well-formed report.

Speed is never asserted: these only check that the suites run and report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schnet_ipu.bench.common import Timing, write_report
from schnet_ipu.config import ModelConfig
from schnet_ipu.data import import_qm9
from schnet_ipu.feed import compiled as compiled_feed
from schnet_ipu.training.log import read_records

TINY = ModelConfig(hidden_channels=8, num_filters=8, num_interactions=1, num_gaussians=6, k=4)
ONE_STEP = Timing(warmup=1, steps=1, repeats=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return import_qm9(tmp_path_factory.mktemp("qm9") / "qm9.h5", limit=300, progress=False)


def check_report(report: dict, suite: str, out_dir: Path, module) -> dict:
    """Write the report as the CLI does and check the files and the JSON keys."""
    json_path = out_dir / "report.json"
    write_report(report, module.COLUMNS, module.PLOT, out_dir, json_path)
    loaded = json.loads(json_path.read_text())
    assert set(loaded) >= {"suite", "machine", "commit", "results", "ratios"}
    assert loaded["suite"] == suite
    assert {"cpu", "cores", "cpu_bf16", "torch", "gpu", "python"} <= set(loaded["machine"])
    native = "yes" if loaded["machine"]["cpu_bf16"] else "no"  # auto's bf16 rests on it
    assert f"bf16 dot products {native}," in (out_dir / f"{suite}.md").read_text()
    assert loaded["results"]
    for ext in ("json", "md", "png"):
        assert (out_dir / f"{suite}.{ext}").stat().st_size > 0
    return loaded


def test_throughput(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import throughput

    report = throughput.run(  # compiling costs minutes; test_backend covers it
        store, sample=200, size=TINY, timing=ONE_STEP, workers=0, batch_molecules=8, compile=False
    )
    loaded = check_report(report, "throughput", tmp_path, throughput)
    names = {r["name"] for r in loaded["results"]}
    assert {"packed radius+tuple", "packed knn+lpfhp", "stock PyG SchNet"} <= names
    replicated = next(r for r in loaded["results"] if r["name"] == "packed radius+tuple 2 replicas")
    assert replicated["replicas"] == 2 and replicated["molecules_per_s"] > 0
    assert loaded["ratios"]["best_single_process"] != "packed radius+tuple 2 replicas"
    for key in ("packed_vs_pyg", "single_process_vs_pyg", "packed_vs_padded"):
        assert loaded["ratios"][key] > 0
    assert throughput.RECIPE not in names  # the shipped recipe compiles: only with compile=True


def test_throughput_times_the_shipped_recipe() -> None:
    """The recipe variant trains as configs/qm9.yaml resolves: its keys, 2 replicas, compiled."""
    from schnet_ipu.bench import throughput
    from schnet_ipu.config import load_config

    cfg = load_config("configs/qm9.yaml", ["backend.device=cpu", *throughput.recipe_overrides()])
    shipped = load_config("configs/qm9.yaml", ["backend.device=cpu"])
    assert cfg == shipped and shipped.backend.compile and shipped.packing.packs_per_batch == 16
    variant = [row for row in throughput.variants((), True) if row[0] == throughput.RECIPE]
    assert variant == [
        (throughput.RECIPE, "radius", "tuple", True, "table", shipped.backend.replicas)
    ]


def test_loader(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import loader

    small = ("data.val=0.1", "data.test=0.1", "packing.packs_per_batch=2")
    report = loader.run(store, small, workers=(0, 1), pyg_molecules=50)
    loaded = check_report(report, "loader", tmp_path, loader)
    names = [r["name"] for r in loaded["results"]]
    torch_program = ["ours 0 workers, torch program"] if compiled_feed.AVAILABLE else []
    assert names == [
        "ours 0 workers",
        "ours 1 workers",
        *torch_program,
        "ours device-resident",
        "stock PyG DataLoader",
    ]
    assert loaded["ratios"]["default_vs_pyg_warm"] > 0 and loaded["ratios"]["peak_rss_mb"] > 0


def test_batching(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import batching

    report = batching.run(
        store, sample=120, water_clusters=12, water_sizes=(1, 2), size=TINY,
        batch_sizes=(8,), max_shapes=1, repeats=1,
    )  # fmt: skip
    loaded = check_report(report, "batching", tmp_path, batching)
    algorithms = {r["algorithm"] for r in loaded["results"]}
    assert algorithms == {"lpfhp", "tuple", "pad_to_max", "static_constant", "static_2n",
                          "static_64", "dynamic"}  # fmt: skip
    assert {r["dataset"] for r in loaded["results"]} == {"qm9", "water"}


def test_model(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import model

    loaded = check_report(model.run(str(store), **model.QUICK), "model", tmp_path, model)
    names = {r["name"] for r in loaded["results"]}
    assert {"ours knn", "pyg knn", "pyg radius"} <= names
    assert all(r["molecules_per_s"] > 0 for r in loaded["results"])


def test_gpu_suite_runs_on_cpu(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import gpu

    tiny = ["model.hidden_channels=8", "model.num_filters=8", "model.num_interactions=1",
            "model.num_gaussians=6", "loader.workers=0"]  # fmt: skip
    report = gpu.run(
        store, "cpu", subset=150, rounds=1, pyg_batches=(16,), precisions=("bf16",),
        molecules_per_step=16, overrides=tiny, variants=("fused",), profile=True,
    )  # fmt: skip
    loaded = check_report(report, "gpu", tmp_path, gpu)
    rows = {r["name"]: r for r in loaded["results"]}
    assert set(rows) == {"ours bf16 eager", "stock PyG SchNet batch 16"}  # no graphs on a CPU
    assert loaded["device"]["name"].startswith("cpu") and loaded["device"]["torch"]
    for row in rows.values():
        assert row["epoch_seconds"] > 0 and row["molecules_per_s"] > 0
    assert rows["ours bf16 eager"]["graph_recaptures"] == 0
    assert rows["ours bf16 eager"]["val_mae"] > 0
    assert loaded["ratios"]["ratio_vs_pyg_best"] > 0
    assert any("ours tf32 fused: the Triton kernels need CUDA" in n for n in loaded["notes"])
    (profile,) = loaded["profiles"].values()  # the profiled variant of ours
    assert profile["steps"] > 0 and profile["top_per_step"][0]["ms_per_step"] > 0


def test_dense(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import dense

    report = dense.run(
        store, sample=120, water_clusters=30, water_sizes=(1, 3), size=TINY, timing=ONE_STEP,
        batch_molecules=8,
    )  # fmt: skip
    loaded = check_report(report, "dense", tmp_path, dense)
    rows = loaded["results"]
    assert {(r["dataset"], r["graph"], r["message_passing"]) for r in rows} == {
        (d, g, m) for d in ("qm9", "water") for g in ("radius", "knn") for m in ("sparse", "dense")
    }
    assert all(0 < r["pair_efficiency"] <= 1 and r["molecules_per_s"] > 0 for r in rows)


@pytest.mark.slow  # spawns two replica processes: about a minute on 2 cores
def test_balance(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import balance

    report = balance.run(
        store, sample=150, water_clusters=40, water_sizes=(1, 3), batch=8, epochs=1, size=TINY
    )
    loaded = check_report(report, "balance", tmp_path, balance)
    rows = loaded["results"]
    assert {(r["dataset"], r["batching"], r["schedule"]) for r in rows} == {
        (d, b, s) for d in ("qm9", "water") for b in ("dynamic", "packs")
        for s in ("round_robin", "cost_model")
    }  # fmt: skip
    assert all(r["straggler"] >= 1 and r["epoch_s"] > 0 for r in rows)
    packs = [r for r in rows if r["batching"] == "packs" and r["steps"] * 2 == r["batches"]]
    assert all(r["predicted_straggler"] == pytest.approx(1.0) for r in packs)


def test_accuracy(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import accuracy

    shrink = ("data.val=30", "data.test=30", "model.hidden_channels=16", "model.num_filters=16")
    shrink += ("backend.compile=false",)  # the recipe's 2 replicas, without the compile time
    shrink += ("packing.packs_per_batch=4",)  # the recipe's 16 need more than this store's packs
    shrink += ("optim.beat_baseline=false",)  # 1 s of training need not beat the baseline
    report = accuracy.run(store, 0.02, 0, tmp_path, shrink)
    loaded = check_report(report, "accuracy", tmp_path, accuracy)
    ours, stock = loaded["results"]
    for row in (ours, stock):
        assert row["test_mae"] > 0 and row["molecules_seen"] > 0 and row["curve"]
    assert (tmp_path / "accuracy_vs_time.png").stat().st_size > 0
    assert loaded["ratios"]["test_mae_ours_over_pyg"] > 0


def test_accuracy_ours_only_from_the_command_line(store: Path, tmp_path: Path) -> None:
    """``--subset N`` holds out a tenth each for validation and test (the config's 10,000
    each would leave nothing to train on, which broke ``--quick``)."""
    from schnet_ipu.bench.__main__ import main

    shrink = ["model.hidden_channels=16", "model.num_filters=16"]
    shrink += ["backend.compile=false", "backend.replicas=1", "optim.beat_baseline=false"]
    sets = [arg for value in shrink for arg in ("--set", value)]
    argv = ["accuracy", "--minutes", "0.01", "--ours-only", "--store", str(store)]
    report = main([*argv, "--subset", "280", "--out-dir", str(tmp_path), *sets])
    assert [row["name"] for row in report["results"]] == ["ours (configs/qm9.yaml)"]
    assert report["ratios"] == {} and "ours alone" in report["notes"][0]
    assert (tmp_path / "accuracy.json").is_file()


def test_accuracy_in_a_run_folder_resumes_there(store: Path, tmp_path: Path) -> None:
    """``--run-dir``: our run stays in that folder, and the same command again resumes it
    (finished here, so it trains no further and reports the same run) instead of starting
    afresh."""
    from schnet_ipu.bench.__main__ import main

    shrink = ["data.val=30", "data.test=30", "model.hidden_channels=16", "model.num_filters=16"]
    shrink += ["backend.compile=false", "backend.replicas=1", "optim.beat_baseline=false"]
    sets = [arg for value in shrink for arg in ("--set", value)]
    sets += ["--set", "logging.log_every=1"]  # a step record for every call
    run_dir = tmp_path / "ours"
    argv = ["accuracy", "--minutes", "0.01", "--ours-only", "--store", str(store), *sets]
    argv += ["--run-dir", str(run_dir)]
    first = main([*argv, "--out-dir", str(tmp_path / "first")])["results"][0]
    steps = len(read_records(run_dir / "metrics.jsonl", "step"))
    assert (run_dir / "checkpoints/last.pt").is_file() and steps > 0
    again = main([*argv, "--out-dir", str(tmp_path / "again")])["results"][0]
    assert len(read_records(run_dir / "metrics.jsonl", "step")) == steps
    for key in ("test_mae", "best_val_mae", "molecules_seen", "epochs", "curve"):
        assert again[key] == first[key], key


@pytest.mark.usefixtures("restore_threads")  # the step ratio runs on one thread
def test_periodic(tmp_path: Path) -> None:
    from schnet_ipu.bench import periodic

    report = periodic.run(frames=60, compare=3, steps=2, trained=40)
    loaded = check_report(report, "periodic", tmp_path, periodic)
    assert loaded["ratio_to_vesin"]["vesin"] == 1.0 and loaded["ratio_to_vesin"]["ase"] > 0
    assert loaded["pairs_per_frame"] > 0 and loaded["periodic_over_molecular"] > 0
    assert set(loaded["step_ms"]) == {"periodic", "molecular"}


def test_calculator(tmp_path: Path) -> None:
    from schnet_ipu.bench import calculator

    rows = [("molecule", "paper", calculator.molecule(6)),
            ("Cu fcc", "metal", calculator.copper((1, 1, 1)))]  # fmt: skip
    loaded = check_report(
        calculator.run(quick=True, structures=rows), "calculator", tmp_path, calculator
    )
    names = {r["name"] for r in loaded["results"]}
    assert names == {"calculator float32", "calculator float64", "exported float32",
                     "exported float64"}  # fmt: skip
    for row in loaded["results"]:
        assert row["ms_per_call"] > 0 and row["load_avg"] is not None
        assert (row["md_steps_per_s"] or 0) > 0 or row["name"].startswith("exported")


def test_hosts(store: Path, tmp_path: Path) -> None:
    from schnet_ipu.bench import hosts

    overrides = [f"data.path={store}", "data.subset=0", "data.val=30", "data.test=30"]
    report = hosts.run("configs/qm9_quickstart.yaml", overrides, host_counts=(2,))
    loaded = check_report(report, "hosts", tmp_path, hosts)
    rows = loaded["results"]
    assert [(r["hosts"], r["rank"]) for r in rows] == [(1, 0), (1, 0), (2, 0), (2, 1)]
    assert rows[0]["held_molecules"] == rows[1]["held_molecules"] == 300  # the whole store
    assert rows[2]["held_molecules"] + rows[3]["held_molecules"] == 300  # shares
    assert rows[2]["held_atoms"] + rows[3]["held_atoms"] == rows[1]["held_atoms"]
    assert all(r["peak_rss_gb"] > 0.1 for r in rows)  # a process with torch imported
    assert set(loaded["ratios"]) == {"2 hosts / 1 host, peak per host",
                                     "1 host with shards / without"}  # fmt: skip


def test_runner_refuses_another_suites_option() -> None:
    from schnet_ipu.bench.__main__ import main

    for argv in (["dense", "--minutes", "1"], ["calculator", "--config", "c.yaml"]):
        with pytest.raises(SystemExit):
            main(argv)
