"""The project's error hierarchy and the one boundary that turns errors into messages.

Every error a user can fix derives from :class:`UserError`; its message names the culprit
(file, config key, record) and says what to do. The modules keep their own subclasses
(``ConfigError``, ``StoreError``, ``PackingError``, ``LoaderError``, ``DeviceError``,
``TrainingError``, ``CheckpointError``, ``OutputPathError``), each also deriving from the
builtin it always did.

Every command runs through :func:`run_cli`: a ``UserError`` or an expected OS error (missing
file, a file where a folder should be, no permission, disk full) becomes one line
``error: <culprit>: <what is wrong and what to do>`` on stderr and exit code 2; anything else
is a bug and keeps its traceback. A Ctrl-C that a run turns into a saved stop
(:func:`on_ctrl_c`) ends it with exit code 130 (``EXIT_INTERRUPTED``); the commands log
through :func:`configure_logging`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # Ctrl-C: the checkpoint was saved first (the shells' 128 + SIGINT)
INTERRUPTED = "interrupted (Ctrl-C)"

# Errnos of OSErrors that are the environment's fault, not a bug, besides the subclasses below.
_EXPECTED_ERRNOS = {
    errno.ENOSPC: "no space left on the device; free some space and re-run",
    errno.EDQUOT: "disk quota exceeded; free some space and re-run",
    errno.EROFS: "read-only file system; choose a writable path",
    errno.EFBIG: "file too large (file system or `ulimit -f` limit); free space or raise it",
}
_EXPECTED_OS_ERRORS = {
    FileNotFoundError: "not found; check the path",
    FileExistsError: "a file is in the way; move it or choose another path",
    IsADirectoryError: "is a folder, a file was expected; choose a file path",
    NotADirectoryError: "a file is in the way of a folder; move it or choose another path",
    PermissionError: "permission denied; check the file's permissions or choose another path",
}


class UserError(Exception):
    """Bad input or environment the user can fix; the message names the culprit."""


class CheckpointError(UserError, ValueError):
    """A checkpoint file that cannot be used (unreadable, unsafe or from another program)."""


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (a non-finite loss, say); the last good checkpoint is kept."""


class ReplicaWaitError(UserError, TimeoutError):
    """A replica waited too long for the others (rank 0's data, a gradient reduction)."""


class RunDirError(UserError, ValueError):
    """A run directory's logs that cannot be used as they are."""


class OutputPathError(UserError, ValueError):
    """An output path that is a folder, or a file the command reads (writing would replace
    it)."""


def describe_os_error(err: OSError) -> str | None:
    """``<file>: <what is wrong and what to do>`` for an expected OS error, else None."""
    hint = _EXPECTED_ERRNOS.get(err.errno)
    if hint is None:
        hint = next((h for cls, h in _EXPECTED_OS_ERRORS.items() if isinstance(err, cls)), None)
    if hint is None:
        return None
    culprit = err.filename if err.filename is not None else (err.strerror or str(err))
    return f"{culprit}: {hint}"


def user_message(err: BaseException) -> str | None:
    """The one-line message for a user error or expected OS error, None for anything else."""
    if isinstance(err, UserError):
        text = str(err)
    elif isinstance(err, OSError):
        text = describe_os_error(err)
        if text is None:
            return None
    else:
        return None
    return " ".join(text.split())  # one line, whatever the message held


def configure_logging(level: int = logging.INFO) -> None:
    """The commands' log lines on stderr: time and message (spawned replicas set theirs
    from the launcher's level)."""
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


@contextmanager
def on_ctrl_c(handler: Callable[[], None]) -> Iterator[None]:
    """Within the block a Ctrl-C (SIGINT) calls ``handler`` instead of raising
    KeyboardInterrupt; outside the main thread, where no handler can be set, Ctrl-C stays
    as it is."""
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: handler())
    except ValueError:
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def run_cli(main: Callable[[], object]) -> int:
    """Run a command's body and return its exit code (its own when it returns an int, else
    0); user errors -> one line on stderr and exit code 2; a Ctrl-C that nothing turned
    into a saved stop (a run's start-up, an import: both resume when run again) -> one line
    and exit code 130; output piped into a reader that stopped early (``| head``) ends
    quietly, as other command-line tools do."""
    try:
        result = main()
        return result if isinstance(result, int) else 0
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final
        # flush does not raise again (the Python docs' advice for SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UserError, OSError) as err:
        message = user_message(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


def positive_float(text: str) -> float:
    """argparse type for lengths such as ``--cutoff``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
