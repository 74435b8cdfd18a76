"""One writer per run folder: an exclusive lock that a run holds for its whole life.

    with hold_run_lock(Path(cfg.logging.run_dir), holder=launcher_rank() == 0):
        ...  # train, resume or --fresh: the only process writing in that folder

A second process that finds the lock held raises :class:`RunLockError` (one line naming the
folder and the holder's pid and host; ``run_cli`` exits 2) before it has written anything.

Design
------
The lock is a POSIX record lock (``fcntl.lockf``, non-blocking) on ``.<name>.lock`` beside
the run folder, which also holds the holder's pid, host and start time as one JSON line.

* Why a kernel lock and not only a pid/host file: the kernel (on NFS, the server) drops the
  lock when its process dies, SIGKILL and out-of-memory kills included, so a stale lock is
  known exactly, without guessing from a pid, which cannot be checked on another host and
  can be reused on this one. The pid/host record only names the holder in the refusal, and a
  record found in a lock that is free means its writer died holding it: the new run takes
  over with a warning.
* Why ``lockf`` (fcntl byte-range locks) and not ``flock``: NFS carries byte-range locks to
  the server (NFSv3 through NLM/statd, NFSv4 in the protocol), so two hosts exclude each
  other; Linux emulates ``flock`` on NFS with them since 2.6.12, but some cluster file
  systems keep ``flock`` node-local (Lustre mounted with ``localflock``). After a node is
  lost, an NFSv4 server frees its locks when the client's lease runs out (90 s by default),
  an NFSv3 server when the client reboots; until then the folder is reported held by that
  node's pid. A mount with ``nolock`` or ``local_lock=all`` makes every lock node-local (two
  hosts are then not excluded); a file system without record locks (ENOLCK, EOPNOTSUPP) gets
  a warning and an unlocked run rather than no run.
* Why beside the folder, not in it: ``--fresh`` deletes the folder while the lock is held,
  and a run refused for bad input leaves the folder exactly as it was. The file is removed
  when the lock is released, so nothing stays behind after a clean exit.
* Byte-range locks belong to the process, not the file descriptor: a second ``lockf`` in the
  same process succeeds and closing any descriptor of the file drops the lock. So the lock
  is taken in one place, ``train.py`` (training, evaluate, predict), and a second hold of
  one folder in the same process is a programming error, raised (``_HELD_HERE``) rather
  than let its release drop the first. Children do not inherit the lock: under
  ``launch_replicas`` the parent holds it for its spawned replicas, under torchrun or
  PopRun rank 0 does.
* Removing the file on release races with a process that opened it just before: that one
  may lock the removed file. So after locking, the descriptor's inode is compared with the
  path's and the attempt repeated when they differ.

This module imports no torch, so ``train.py`` takes the lock before its heavy imports and a
second run is refused within a fraction of a second.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from schnet_ipu.errors import UserError

log = logging.getLogger("schnet_ipu")

# errnos of a lock held by another process (Linux gives EAGAIN, others EACCES)
_HELD_ERRNOS = (errno.EAGAIN, errno.EACCES)
# errnos of a file system that keeps no byte-range locks
_NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_ATTEMPTS = 10  # tries when the lock file is removed under us between open and lock

_HELD_HERE: set[str] = set()  # lock paths this process holds


class RunLockError(UserError, RuntimeError):
    """The run folder is in use by another process (the message names its pid and host)."""


def lock_path(run_dir: Path) -> Path:
    """``<parent>/.<name>.lock`` of the run folder (resolved, so every spelling of one
    folder has one lock)."""
    run_dir = Path(run_dir).resolve()
    return run_dir.with_name(f".{run_dir.name}.lock")


def launcher_rank() -> int:
    """This process's rank as its launcher set it, before any process group exists:
    PopRun's instance index, torchrun's ``RANK``, else 0 (a single process, or the parent
    that spawns local replicas)."""
    try:
        import popdist
    except ImportError:
        popdist = None
    if popdist is not None and popdist.isPopdistEnvSet():
        return int(popdist.getInstanceIndex())
    return int(os.environ.get("RANK", "0"))


@contextmanager
def hold_run_lock(run_dir: Path, holder: bool = True) -> Iterator[None]:
    """Hold the run folder's lock for the ``with`` block (only where ``holder``; other
    ranks pass False and hold nothing). Raises :class:`RunLockError` when another process
    holds it; takes over, with a warning, a lock whose holder died."""
    if not holder:
        yield
        return
    path = lock_path(run_dir)
    key = str(path)
    if key in _HELD_HERE:  # its release would drop the outer hold's lock (see Design)
        raise RuntimeError(f"{run_dir}: this process holds its run lock already")
    made = _missing_parents(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, Path(run_dir))
    if fd is None:
        yield
        return
    _HELD_HERE.add(key)
    try:
        yield
    finally:
        _HELD_HERE.discard(key)
        _release(path, fd)
        for folder in made:  # folders made only for the lock, if the run left them empty
            try:
                folder.rmdir()
            except OSError:
                break


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder record of a lock file (pid, host, started), None if absent or torn."""
    try:
        return _parse(path.read_bytes())
    except OSError:
        return None


def _acquire(path: Path, run_dir: Path) -> int | None:
    """Lock ``path`` and write this process's record; the descriptor, or None where the
    file system has no locks."""
    for _ in range(_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            record = _parse(os.pread(fd, 4096, 0))
            os.close(fd)
            if err.errno in _HELD_ERRNOS:
                raise RunLockError(_refusal(run_dir, path, record)) from None
            if err.errno in _NO_LOCKS_ERRNOS:
                log.warning(
                    "%s: this file system keeps no locks (%s); %s is not protected from a "
                    "second run",
                    path,
                    err.strerror,
                    run_dir,
                )
                return None
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # we locked a file that a releasing holder had just removed
    else:
        raise RunLockError(f"{path}: the lock file keeps being replaced; is another run starting?")
    stale = _parse(os.pread(fd, 4096, 0))
    if stale is not None:
        log.warning(
            "%s: taking over the lock of pid %s on host %s (since %s), which no longer holds "
            "it (killed, or its node lost)",
            run_dir,
            stale.get("pid"),
            stale.get("host"),
            stale.get("started"),
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)
    return fd


def _release(path: Path, fd: int) -> None:
    """Empty and remove the lock file while still holding it, then unlock (by closing)."""
    try:
        os.ftruncate(fd, 0)  # a file someone still opened then reads as no holder
        if _same_file(fd, path):
            path.unlink()
    except OSError as err:  # a vanished or read-only folder: the kernel still unlocks below
        log.warning("%s: could not remove the lock file (%s)", path, err.strerror)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw.decode())
    except ValueError:  # empty, torn, or not ours
        return None
    return record if isinstance(record, dict) else None


def _refusal(run_dir: Path, path: Path, record: dict[str, Any] | None) -> str:
    if record is None:
        holder = "another process (it has not written its pid yet)"
    else:
        holder = (
            f"pid {record.get('pid')} on host {record.get('host')} (since {record.get('started')})"
        )
    return (
        f"run folder {run_dir} is in use by {holder}: one run writes there at a time (lock "
        f"{path}). Wait for that run to end, stop it, or choose another logging.run_dir"
    )


def _missing_parents(folder: Path) -> list[Path]:
    """The folders of ``folder`` (itself first) that do not exist yet."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing
