"""Writes that leave a file whole: appends that either land entirely or not at all, and
outputs that never replace what the command reads.

The run folder's records (:mod:`schnet_ipu.training.log`) and checkpoints
(:mod:`schnet_ipu.checkpoint`) are written through these, so a full disk or a file-size
limit never leaves a torn line or a half checkpoint behind. The commands that write a file
the user names (``train.py export``, ``predict``) check it first with :func:`check_output`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from schnet_ipu.errors import OutputPathError, RunDirError


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


def check_output(out: Path, inputs: Iterable[tuple[str, Path]]) -> None:
    """Refuse, naming ``out`` as given, an output path that is a folder or one of the
    ``inputs`` ((what, path) pairs: the files the command reads), compared as files, so a
    symlink or hard link to an input, or an input reached through a symlinked folder, is
    refused too."""
    if out.is_dir():
        raise OutputPathError(f"{out}: is a folder; give the path of a file to write (--out)")
    if not out.exists():
        return
    for what, source in inputs:
        if source.exists() and os.path.samefile(out, source):
            raise OutputPathError(
                f"{out}: is the {what} this command reads ({source}); writing there would "
                "replace it: choose another --out"
            )
