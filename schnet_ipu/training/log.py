"""The run directory's logs: metrics.jsonl, optional wandb (logging.wandb_mode), the plot.

``metrics.jsonl`` holds one JSON object per line with ``"kind"`` in ``step``, ``epoch``,
``final`` (and ``stage`` for the timings of data preparation, ``rollback`` for each rollback
of the divergence guard, :mod:`schnet_ipu.training.guard`). Epoch records carry
``epoch``, ``train_loss``, ``val_mae``, ``molecules_per_s``; the final record carries
``test_mae``, ``test_rmse``, ``baseline_test_mae``, ``unit``, ``wall_seconds``.

Each record is flushed to disk (fsync) before ``write`` returns, so the training loop writes
an epoch's record before the checkpoint that claims the epoch. A crash can leave at most a
torn last line: reading skips it with a warning and :func:`truncate_after` (run on resume)
drops it, rewriting the log atomically. A write that fails (full disk, file-size limit,
read-only folder) leaves no torn line: it is cut back off and the run stops with one line
(:func:`~schnet_ipu.files.write_failed`), so the records before it and the last checkpoint
stay valid.
"""

from __future__ import annotations

import json
import logging
import math
import os
from itertools import accumulate
from pathlib import Path
from typing import Any

from schnet_ipu.config import Config, ConfigError
from schnet_ipu.errors import RunDirError
from schnet_ipu.files import append_whole, write_failed

log = logging.getLogger("schnet_ipu")

WANDB_ID_FILE = "wandb_run_id"


class RunLog:
    """Appends records to ``run_dir/metrics.jsonl`` and mirrors them to wandb when enabled.

    A resumed run continues its wandb run: the id wandb gave it is kept in
    ``run_dir/wandb_run_id`` (wandb resumes a run only by its id, ``resume="allow"``).
    """

    def __init__(self, run_dir: Path, cfg: Config, resumed: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        if cfg.logging.wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as err:
                raise ConfigError(
                    f"logging.wandb_mode={cfg.logging.wandb_mode} needs the wandb package: "
                    "pip install 'schnet-ipu[wandb]'"
                ) from err
            id_path = run_dir / WANDB_ID_FILE
            run_id = id_path.read_text().strip() if resumed and id_path.exists() else None
            self.wandb = wandb.init(
                project="schnet-ipu",
                dir=str(run_dir),
                id=run_id,
                mode=cfg.logging.wandb_mode,
                config=cfg.to_dict(),
                resume="allow",
            )
            id_path.write_text(self.wandb.id + "\n")

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record, whole or not at all: a write that fails part-way (disk full,
        file-size limit, read-only folder) is cut back off and raises :class:`RunDirError`."""
        record = {"kind": kind, **{k: _plain(v) for k, v in fields.items()}}
        append_whole(self.path, (json.dumps(record) + "\n").encode())
        if self.wandb is not None:
            numbers = {f"{kind}/{k}": v for k, v in record.items() if isinstance(v, (int, float))}
            self.wandb.log(numbers)

    def close(self, exit_code: int = 0) -> None:
        """Finish the wandb run (with ``exit_code``, as the process exits; a resume goes on
        with it). Needed on every way out: a stopped replica leaves by ``os._exit``, which
        skips wandb's own exit hook."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None


def read_records(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Records of ``path`` (of one ``kind`` if given). A torn last line (a crash mid-write)
    is skipped with a warning; a damaged line before it raises :class:`RunDirError`."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record:
                raise ValueError("not a record object with a 'kind'")
        except ValueError as err:
            if number == len(lines) and not line.endswith("\n"):
                log.warning("%s: line %d is torn (a crash mid-write); skipping it", path, number)
                break
            raise RunDirError(
                f"{path}: line {number} is not a metrics record ({err}); remove that line "
                "or the run directory"
            ) from err
        records.append(record)
    return [r for r in records if kind is None or r["kind"] == kind]


def truncate_after(path: Path, epoch: int, call: int) -> None:
    """On resume, drop records written after the checkpoint (they will be written again) and
    a torn last line; the log is replaced atomically (temp file, fsync, rename). An epoch
    record's ``call`` is the host call it was validated at (a budget validates inside
    epochs), so a checkpoint at (epoch, call) keeps the records up to it (records without
    one are whole epochs). The step record and a rollback at (epoch, call) came before the
    checkpoint there (the resumed run goes on from the next call)."""
    kept = [
        r
        for r in read_records(path)
        if r["kind"] == "stage"
        or (r["kind"] == "epoch" and (r["epoch"], r.get("call", math.inf)) <= (epoch, call))
        or (r["kind"] == "step" and (r["epoch"], r["call"]) <= (epoch, call))
        or (r["kind"] == "rollback" and (r["epoch"], r["call"]) <= (epoch, call))
    ]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        append_whole(tmp, "".join(json.dumps(r) + "\n" for r in kept).encode())
        os.replace(tmp, path)
    except OSError as err:
        raise write_failed(path, err) from err
    finally:
        tmp.unlink(missing_ok=True)


def plot_learning_curve(metrics_path: Path, out: Path, unit: str) -> None:
    """Train loss and validation loss/MAE per epoch -> PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = read_records(metrics_path, "epoch")
    if not epochs:
        return
    # epochs trained at each validation (a budgeted run also validates inside epochs)
    x = list(accumulate(r.get("epoch_fraction", 1.0) for r in epochs))
    fig, (ax_loss, ax_mae) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(x, [r["train_loss"] for r in epochs], label="train loss")
    ax_loss.plot(x, [r["val_loss"] for r in epochs], label="validation loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("standardised MSE")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_mae.plot(x, [r["val_mae"] for r in epochs], color="C2")
    ax_mae.set_xlabel("epoch")
    ax_mae.set_ylabel(f"validation MAE ({unit})")
    ax_mae.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
