"""schnet-ipu: train SchNet on packed fixed-shape batches.

    python train.py --config configs/qm9_quickstart.yaml [section.key=value ...]
    python train.py --config configs/qm9.yaml --print-config optim.lr=5e-4
    python train.py evaluate --run runs/qm9_quickstart [--split test]
    python train.py predict --run runs/qm9_quickstart [--split test] [--out predictions.csv]
    python train.py predict --model best.pt [--model b.pt ...] --input new.extxyz --out out.extxyz
    python train.py export --run runs/emt_forces --out emt.torchscript.pt [--dtype float64]

``predict`` has two forms: with --run alone, the run's own data split to CSV; with --input,
new structures (any ASE-readable file) to extxyz.

Re-running a training command in the same run directory resumes from its last checkpoint;
--fresh discards that run instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from contextlib import nullcontext
from pathlib import Path

from schnet_ipu.config import resolve_config, resolved_yaml
from schnet_ipu.errors import configure_logging, run_cli

log = logging.getLogger("schnet_ipu")


def main(argv: list[str]) -> int:
    """Every command's errors pass :func:`run_cli`: user errors become one line, exit 2."""
    configure_logging()
    if argv and argv[0] == "export":
        return run_cli(lambda: export_command(argv[1:]))
    if argv and argv[0] == "evaluate":
        return run_cli(lambda: evaluate_command(argv[1:]))
    if argv and argv[0] == "predict":
        return run_cli(lambda: predict_command(argv[1:]))
    return run_cli(lambda: train_command(argv))


def train_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Train SchNet on packed fixed-shape batches.")
    parser.add_argument("--config", type=Path, help="YAML config (defaults apply without one)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--print-config", action="store_true", help="print the config, exit")
    parser.add_argument("--fresh", action="store_true", help="discard an existing run directory")
    args = parser.parse_intermixed_args(argv)
    cfg, recipe = resolve_config(args.config, args.overrides)
    if args.print_config:
        print(f"# {recipe.line()}")
        print(resolved_yaml(cfg), end="")
        return 0
    log.info(recipe.line())
    from schnet_ipu.training.lock import hold_run_lock, launcher_rank

    # one writer per run folder, refused before the heavy imports (a second run: < 1 s)
    with hold_run_lock(Path(cfg.logging.run_dir), holder=launcher_rank() == 0):
        from schnet_ipu.training.loop import train  # heavy imports only once the config is valid

        final = train(cfg, fresh=args.fresh)
    if final:  # rank 0's; under torchrun the other ranks end without a line
        print(final_line(final, Path(cfg.logging.run_dir)))
    return 0


def final_line(final: dict, run_dir: Path) -> str:
    """One line for a finished run: its test errors beside the trivial baselines (the whole
    final record stays in the run folder's metrics.jsonl)."""
    unit = final["unit"]
    parts = [f"test MAE {final['test_mae']:.4g} {unit} over {final['test_molecules']} structures"]
    parts[0] += f" (dressed-atom baseline {final['baseline_test_mae']:.4g} {unit})"
    for label, key, per in (("force", "force_mae", "/Angstrom"), ("stress", "stress_mae", "/A^3")):
        if f"test_{key}" in final:  # absent when no test frame carries the label
            parts.append(f"{label} MAE {final[f'test_{key}']:.4g} {unit}{per}")
            if f"baseline_{key}" in final:
                parts[-1] += f" (baseline {final[f'baseline_{key}']:.4g})"
    seconds = final["wall_seconds"]
    return f"{'; '.join(parts)}; {seconds:.0f} s; records in {run_dir / 'metrics.jsonl'}"


def evaluate_command(argv: list[str]) -> int:
    """``train.py evaluate``: a finished run's errors on one of its splits (an ensemble's
    with several --run)."""
    parser = argparse.ArgumentParser(
        prog="train.py evaluate",
        description="Errors of a finished run's model on one of its data splits (metrics as "
        "JSON; parity plot and error histogram in the run folder); several --run: an "
        "ensemble's mean energy.",
    )
    parser.add_argument(
        "--run", type=Path, action="append", help="run directory (repeat for an ensemble)"
    )
    parser.add_argument("--split", default="test", choices=("train", "val", "test"))
    args = parser.parse_args(argv)
    if not args.run:
        parser.error("give --run RUN")
    if len(args.run) > 1:
        from schnet_ipu.training.finished_runs import evaluate_ensemble

        print(json.dumps(evaluate_ensemble(args.run, args.split), indent=2))  # reads only
        return 0
    from schnet_ipu.training.finished_runs import evaluate_run
    from schnet_ipu.training.lock import hold_run_lock

    with hold_run_lock(args.run[0], holder=True):  # its pictures go into the run folder
        print(json.dumps(evaluate_run(args.run[0], args.split), indent=2))
    return 0


PREDICT_FORMS = """two forms:
  predict --run RUN [--split S] [--out F.csv]
      the run's own data split: one CSV row per molecule (index, target, prediction, error)
  predict --model M [--model M2 ...] --input FILE --out F.extxyz   (or --run RUN --input FILE)
      new structures from any ASE-readable file: written as extxyz with predicted energy,
      forces (and stress, and an ensemble's spread)"""


def predict_command(argv: list[str]) -> int:
    """``train.py predict``: a run's split -> CSV (:func:`predict_run_split`), or new
    structures -> extxyz (:func:`predict_new_structures`); see ``PREDICT_FORMS``."""
    parser = argparse.ArgumentParser(
        prog="train.py predict",
        description="Predictions of trained models, in one of two forms (below).",
        epilog=PREDICT_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run", type=Path, help="run directory")
    parser.add_argument(
        "--split",
        default="test",
        choices=("train", "val", "test"),
        help="the run's split to predict (without --input)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        help="checkpoint file or run folder (repeat for an ensemble); needs --input",
    )
    parser.add_argument(
        "--input",
        type=Path,
        help="ASE-readable new structures: writes them with predictions as extxyz to --out",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="CSV path (default RUN/predictions_SPLIT.csv); with --input an extxyz path "
        "(default RUN/predictions.extxyz)",
    )
    args = parser.parse_args(argv)
    if not (args.model or args.run):
        parser.error("give --run RUN or --model FILE")
    if args.input is not None and args.out is None and not args.run:
        parser.error("--model with --input needs --out")
    if args.input is None and args.run is None:
        parser.error("predict of a split needs --run RUN (the run's data)")
    from schnet_ipu.training.lock import hold_run_lock

    # predict writes its output into the run folder by default: it holds the folder's lock
    # there; --out elsewhere (or --model files alone) only reads
    writes_there = args.run is not None and (
        args.out is None or args.run.resolve() in args.out.resolve().parents
    )
    lock = hold_run_lock(args.run, holder=writes_there) if args.run else nullcontext()
    with lock:
        if args.input is not None:
            return predict_new_structures(args.model or [args.run], args.input, args.out, args.run)
        return predict_run_split(args.run, args.split, args.out)


def predict_run_split(run: Path, split: str, out: Path | None) -> int:
    """``predict --run RUN``: the run's own ``split`` -> CSV (default in the run folder)."""
    from schnet_ipu.training.finished_runs import predict_split

    out = out or run / f"predictions_{split}.csv"
    rows = predict_split(run, split, out)
    print(f"wrote {rows} predictions to {out}")
    return 0


def predict_new_structures(
    models: list[Path], source: Path, out: Path | None, run: Path | None
) -> int:
    """``predict --model M --input FILE``: new structures -> extxyz (default in ``run``)."""
    from schnet_ipu.inference.predictor import predict_file

    out = out or run / "predictions.extxyz"
    frames = predict_file(models, source, out)
    print(f"wrote {frames} structures with predicted energy and forces to {out}")
    return 0


def export_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="train.py export",
        description="Write a trained model as a TorchScript file that plain torch loads.",
    )
    parser.add_argument("--run", type=Path, required=True, help="run folder or checkpoint file")
    parser.add_argument("--out", type=Path, required=True, help="TorchScript file to write")
    parser.add_argument("--checkpoint", default="best", choices=("best", "last"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = parser.parse_args(argv)
    import torch

    from schnet_ipu.inference.export import export_model

    meta = export_model(args.run, args.out, args.checkpoint, getattr(torch, args.dtype))
    print(f"wrote {args.out} (TorchScript): {meta['interface']}; energy {meta['energy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
