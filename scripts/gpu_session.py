"""A lent GPU's checks in one call, in order of worth, while a time budget lasts.

    python scripts/gpu_session.py --out "$OUT" --seconds 520
    python scripts/gpu_session.py --out "$OUT" --seconds 300 --only forces-each,tests

Stages: the tests that need CUDA (Triton kernels on CUDA tensors, the captured and compiled
steps); the gpu suite (a full QM9 epoch with profiles) at 512 to 4,096 molecules per step,
the compiled variants apart (their compile time is the least predictable); force-training
steps of every op flavour on the EMT clusters and the xTB molecules; a sweep of the Triton
kernels' rows per program and warps; stock PyG at batch 32; each force variant alone
(``forces-each``, to find a crash); configs/qm9.yaml trained for 4 minutes on the GPU
(``accuracy-4min``: a 10-minute run does not fit in one call; ``-lr`` and ``-p64``: a GPU
recipe); the eager fp32 step and the fastest after equal epochs, two seeds each. Each stage
runs in its own process under its own time limit, so one that fails or hangs leaves the
rest; a stage whose estimate does not fit in the time left is skipped, and said so. Reports
(JSON) and logs go to ``--out``; the last lines printed are a table of stages. The estimates
are one H200's (2026-11-26). The reports' ``commit`` is what git says on the device machine,
which may not be the tree sent: correct it when committing a report."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/model/test_triton_ops.py",
    "tests/backends/test_cuda.py",
    "tests/backends/test_compiled_step.py",
]
SWEEP_ROWS, SWEEP_WARPS = (2, 4, 8, 16), (4, 8, 16)
SWEEP_STEPS = 40
# gpu.VARIANTS under backend.compile
COMPILED = "compiled,compiled table,compiled fused,compiled fused table"
# issue 40's "validation MAE after equal epochs within seed noise of the eager fp32 step": the
# reference and the fastest step (gpu-h200-2048-compiled-8x8), each with two seeds
EQUAL_EPOCHS, EQUAL_SEEDS, EQUAL_MOLECULES = 10, (0, 1), 2048
EQUAL_VARIANTS = {
    "fp32 eager": ["backend.precision=fp32", "backend.cuda_graphs=false", "model.filter=exact"],
    "tf32 compiled table graph": ["backend.precision=tf32", "backend.compile=true",
                                  "model.filter=table"],
}  # fmt: skip


def stages(out: Path) -> list[tuple[str, float, float, list[str]]]:
    """(name, estimate s, limit s, command) in the order they run."""
    me = [sys.executable, str(Path(__file__).resolve()), "--out", str(out)]

    def suite(molecules: int, name: str, precisions: str, variants: str, pyg: str) -> list[str]:
        """One gpu-suite stage's command (comma-separated lists; empty: none)."""
        return [*me, "--gpu", str(molecules), "--name", name, "--precisions", precisions,
                "--variants", variants, "--pyg", pyg]  # fmt: skip

    bench = [sys.executable, "-m", "schnet_ipu.bench"]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8",
              "-m", "triton or not triton", *TESTS]  # fmt: skip
    on_cuda = ["--device", "cuda", "--quick", "--set", "packing.packs_per_batch=64"]
    forces = [*bench, "force_step", *on_cuda]
    xtb = [*forces, "--config", "configs/xtb_molecules.yaml"]
    compiled = suite(2048, "gpu-2048-compiled", "tf32", COMPILED, "")

    def accuracy(name: str, *overrides: str) -> list[str]:
        """configs/qm9.yaml for 4 minutes on the GPU, one replica, with ``overrides``."""
        sets = [item for override in overrides for item in ("--set", override)]
        return [*bench, "accuracy", "--minutes", "4", "--ours-only", "--set", "backend.replicas=1",
                "--set", "backend.device=cuda", *sets, "--json", str(out / f"{name}.json"),
                "--out-dir", str(out / name)]  # fmt: skip

    larger = accuracy("accuracy-gpu-4min-p64", "optim.lr=2e-3", "packing.packs_per_batch=64")
    largest = suite(4096, "gpu-4096-compiled", "tf32", "compiled,compiled table", "")
    return [
        ("tests", 95, 150, pytest),
        ("gpu-512", 90, 150, suite(512, "gpu-512", "fp32,tf32,bf16", "fused,table", "")),
        ("gpu-2048", 60, 120, suite(2048, "gpu-2048", "fp32,tf32", "fused,table", "1024")),
        ("forces-emt", 40, 90, [*forces, "--json", str(out / "force-step-emt.json")]),
        ("gpu-2048-compiled", 120, 200, compiled),
        ("gpu-1024", 40, 90, suite(1024, "gpu-1024", "tf32", "fused,table", "")),
        ("sweep", 60, 120, [*me, "--sweep"]),
        ("forces-xtb", 40, 90, [*xtb, "--json", str(out / "force-step-xtb.json")]),
        ("gpu-4096-compiled", 60, 120, largest),
        ("gpu-512-pyg32", 110, 150, suite(512, "gpu-512-pyg32", "tf32", "", "32")),
        ("forces-each", 140, 330, [*me, "--forces-each", *on_cuda]),
        ("accuracy-4min", 260, 400, accuracy("accuracy-gpu-4min")),
        # the CPU recipe gave 27.7 meV on an H200 (4e-3, ~91 molecules per step): a lower rate,
        # and a lower rate on 4x the molecules per step
        ("accuracy-4min-lr", 260, 400, accuracy("accuracy-gpu-4min-lr1e-3", "optim.lr=1e-3")),
        ("accuracy-4min-p64", 260, 400, larger),
        ("equal-epochs", 200, 300, [*me, "--equal-epochs"]),
    ]


def run_stages(out: Path, seconds: float, only: list[str]) -> None:
    """Every stage (``only``: those, in that order) that fits in what is left of
    ``seconds``; logs under ``out``."""
    start, summary = time.monotonic(), []
    every = {stage[0]: stage for stage in stages(out)}
    unknown = [name for name in only if name not in every]
    if unknown:
        raise SystemExit(f"--only: no stage {', '.join(unknown)} (stages: {', '.join(every)})")
    for name, estimate, limit, command in [every[name] for name in only] or every.values():
        left = seconds - (time.monotonic() - start)
        if estimate > left:
            summary.append((name, "skipped (time)", 0.0))
            continue
        tick = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                code = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=min(limit, left)).returncode  # fmt: skip
                status = "ok" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                status = "timed out"
        summary.append((name, status, time.monotonic() - tick))
        print(f"{name}: {status} after {summary[-1][2]:.0f} s", flush=True)
        tail = (out / f"{name}.log").read_text().splitlines()[-4:]
        print("\n".join("    " + line[:200] for line in tail), flush=True)
    print("\nstage              status            seconds")
    for name, status, spent in summary:
        print(f"{name:<18} {status:<17} {spent:7.0f}")


def gpu_stage(molecules: int, name: str, precisions: str, variants: str, pyg: str,
              out: Path) -> None:  # fmt: skip
    """The gpu suite at ``molecules`` per step (stock PyG at that batch size and ``pyg``'s);
    its report as ``out/name.json`` and its plots under ``out/name``."""
    from schnet_ipu.bench import gpu
    from schnet_ipu.bench.common import write_report

    def names(text: str) -> tuple[str, ...]:
        return tuple(item for item in text.split(",") if item)

    report = gpu.run(
        device="cuda", rounds=1, molecules_per_step=molecules, precisions=names(precisions),
        variants=names(variants), pyg_batches=tuple(int(b) for b in names(pyg)),
        profile=bool(names(variants)),
    )  # fmt: skip
    report["command"] = f"python scripts/gpu_session.py ({name})"
    write_report(report, gpu.COLUMNS, gpu.PLOT, out / name, out / f"{name}.json")
    for row in report["results"]:
        print(f"{row['name']:<45} {row['epoch_seconds']:8.3f} s  {row.get('val_mae')}", flush=True)


def sweep_stage(out: Path) -> None:
    """Step time of the fused (exact and table) tf32 steps in their CUDA graphs at ~1,024
    molecules per step, for each rows-per-program x warps of the Triton kernels."""
    import torch

    from schnet_ipu.backends import ReplicaInfo
    from schnet_ipu.bench import common, gpu
    from schnet_ipu.model.ops import triton_kernels
    from schnet_ipu.training import setup as components
    from schnet_ipu.training.data import make_loader, prepare_data

    data = prepare_data(gpu.paper_config(common.QM9_STORE, "cuda", 0, []))
    packs = f"packing.packs_per_batch={common.packs_for(data, 1024)}"
    loader_cfg = gpu.paper_config(common.QM9_STORE, "cuda", 0, [packs])
    loader = make_loader(loader_cfg, data, "train", pin_memory=True, device="cuda")
    calls = list(itertools.islice(loader.epoch(0), 8))  # every setting steps on these
    rows = []
    for filter_, block_rows, warps in itertools.product(("exact", "table"), SWEEP_ROWS,
                                                        SWEEP_WARPS):  # fmt: skip
        triton_kernels.BLOCK_ROWS, triton_kernels.NUM_WARPS = block_rows, warps
        cfg = gpu.paper_config(common.QM9_STORE, "cuda", 0, [
            packs, "backend.precision=tf32", "backend.cuda_graphs=true", "model.ops=triton",
            f"model.filter={filter_}"])  # fmt: skip
        backend = components.make_trainer(cfg, data, ReplicaInfo(), "cuda")[2]
        for call in calls:  # capture and warm-up
            backend.train_call(call)
        torch.cuda.synchronize()
        tick = time.perf_counter()
        steps = sum(len(backend.train_call(calls[i % len(calls)])) for i in range(SWEEP_STEPS))
        torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - tick) / steps
        rows.append({"filter": filter_, "block_rows": block_rows, "num_warps": warps,
                     "step_ms": ms})  # fmt: skip
        print(f"{filter_:<6} rows {block_rows:>3} warps {warps}: {ms:.3f} ms per step", flush=True)
        facts = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "packs": packs, "steps": SWEEP_STEPS, "results": rows}  # fmt: skip
        (out / "triton-sweep.json").write_text(json.dumps(facts, indent=1))  # after each


def forces_each_stage(arguments: list[str]) -> None:
    """Each force_step variant alone (with ``energy``), in its own process: which one fails
    (an illegal memory access ended the EMT force steps of the second H200 call, after every
    variant's first captured step had run; since 83cccf7 none has failed). A variant prints
    its table rows when it passes; one that fails runs again without CUDA graphs under
    CUDA_LAUNCH_BLOCKING=1 (which op launched the bad access), and the first failure once
    more under compute-sanitizer's memcheck (which kernel, which address) where there is one."""
    from schnet_ipu.bench import force_step

    bench = [sys.executable, "-m", "schnet_ipu.bench", "force_step", *arguments]

    def alone(
        name: str, graphs: str, blocking: bool, wrapper: tuple[str, ...] = (), limit: int = 90
    ) -> bool:
        command = [*wrapper, *bench, "--variant", name, "--set", f"backend.cuda_graphs={graphs}"]
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1" if blocking else "0")
        extras = ", blocking" * blocking + ", memcheck" * bool(wrapper)
        how = f"{name} (cuda_graphs={graphs}{extras})"
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True,
                                  timeout=limit)  # fmt: skip
        except subprocess.TimeoutExpired as expired:
            print(f"{how}: timed out after {limit} s", flush=True)
            text = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
            print("\n".join("    " + line for line in (text or "").splitlines()[-30:]), flush=True)
            return False
        lines = (done.stdout + done.stderr).splitlines()
        if done.returncode == 0 and not wrapper:
            rows = [line for line in lines if line.startswith("| ") and "---" not in line]
            print(f"{how}: ok  " + "  ".join(rows[1:]), flush=True)
            return True
        error = next((line for line in reversed(lines) if "Error" in line), "")
        print(f"{how}: exit {done.returncode} {error}", flush=True)
        print("\n".join("    " + line for line in lines[-40:]), flush=True)
        return False

    failed = []  # (variant, the cuda_graphs setting it failed with last)
    for name in force_step.VARIANTS:
        if name != "energy" and not alone(name, "auto", blocking=False):
            failed.append((name, "auto" if alone(name, "false", blocking=True) else "false"))
    sanitizer = shutil.which("compute-sanitizer")
    if failed and sanitizer:
        memcheck = (sanitizer, "--tool", "memcheck", "--print-limit", "8")
        alone(*failed[0], blocking=False, wrapper=memcheck, limit=150)


def equal_epochs_stage(out: Path, device: str = "cuda", subset: int = 0) -> None:
    """``EQUAL_EPOCHS`` epochs of configs/qm9.yaml (``gpu.paper_config``, its cosine schedule
    over the epochs) at ~``EQUAL_MOLECULES`` molecules per step for each ``EQUAL_VARIANTS``
    entry and seed: validation and test MAE as ``out/equal-epochs.json`` (after each run)."""
    from schnet_ipu.bench import common, gpu
    from schnet_ipu.training.data import prepare_data
    from schnet_ipu.training.loop import train

    data = prepare_data(gpu.paper_config(common.QM9_STORE, device, subset, []))
    packs = f"packing.packs_per_batch={common.packs_for(data, EQUAL_MOLECULES)}"
    rows = []
    for (name, extra), seed in itertools.product(EQUAL_VARIANTS.items(), EQUAL_SEEDS):
        run_dir = out / "equal-epochs" / f"{name.replace(' ', '-')}-{seed}"
        settings = [packs, f"optim.epochs={EQUAL_EPOCHS}", f"seed={seed}",
                    "optim.beat_baseline=false", f"logging.run_dir={run_dir}", *extra]  # fmt: skip
        row = {"name": name, "seed": seed, "overrides": settings}
        try:
            final = train(gpu.paper_config(common.QM9_STORE, device, subset, settings), fresh=True)
            row.update(val_mae=final["best_val_mae"], test_mae=final["test_mae"])
        except Exception as error:  # recorded, and the other runs still go
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print(row, flush=True)
        (out / "equal-epochs.json").write_text(json.dumps({"epochs": EQUAL_EPOCHS, "rows": rows},
                                                          indent=1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="reports and logs")
    parser.add_argument("--seconds", type=float, default=520, help="time budget of all stages")
    parser.add_argument("--only", default="", help="these stages (comma-separated), in order")
    # one stage, in its own process (stages() gives the arguments)
    parser.add_argument("--gpu", type=int, help=argparse.SUPPRESS)
    for option in ("--name", "--precisions", "--variants", "--pyg"):
        parser.add_argument(option, default="", help=argparse.SUPPRESS)
    parser.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--forces-each", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--equal-epochs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        gpu_stage(args.gpu, args.name, args.precisions, args.variants, args.pyg, args.out)
    elif args.forces_each is not None:
        forces_each_stage(args.forces_each)
    elif args.sweep:
        sweep_stage(args.out)
    elif args.equal_epochs:
        equal_epochs_stage(args.out)
    else:
        run_stages(args.out, args.seconds, [name for name in args.only.split(",") if name])


if __name__ == "__main__":
    main()
