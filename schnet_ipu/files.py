"""Writes that leave a file whole: appends that either land entirely or not at all.

The run folder's records (:mod:`schnet_ipu.training.log`) and checkpoints
(:mod:`schnet_ipu.checkpoint`) are written through these, so a full disk or a file-size
limit never leaves a torn line or a half checkpoint behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from schnet_ipu.errors import RunDirError


def append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` and fsync; on an OS error the file is truncated back to
    its length before (truncating needs no space) and :class:`RunDirError` names it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise write_failed(path, err) from err
    try:
        length = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # a full disk or a size limit can take part of a write
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as err:
            os.ftruncate(fd, length)
            raise write_failed(path, err) from err
    finally:
        os.close(fd)


def write_failed(path: Path, err: OSError) -> RunDirError:
    """The one-line error of a run-folder write that failed: everything written before it
    is kept, so the run resumes once the cause is gone."""
    return RunDirError(
        f"{path}: could not write ({err.strerror or err}); what was on disk before is kept "
        "(records, last good checkpoint). Free some space, raise the file-size limit or make "
        "the folder writable, then re-run to resume"
    )
