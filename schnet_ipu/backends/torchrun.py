"""torchrun with this project's error boundary: the command for multi-node runs.

    python -m schnet_ipu.backends.torchrun --nnodes=2 --nproc-per-node=G --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB \\
        train.py --config configs/qm9.yaml backend.replicas=2G

Everything torchrun takes, and it behaves as torchrun, with two differences:

* The rendezvous failures a node meets before its workers start end with one line
  ``error: rendezvous HOST:PORT: ...`` naming the endpoint, and exit code 2 (through
  :func:`~schnet_ipu.errors.run_cli`) instead of torch's traceback: a node that cannot reach
  the rendezvous store within ``read_timeout`` (``--rdzv-conf read_timeout=S``, torch's
  default 60 s) and a rendezvous that the other nodes did not join within ``join_timeout``
  (default 600 s). Both are bounded by those timeouts: no node waits for ever.
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the environment sets it: with the agents'
  rendezvous store shared with the workers (torch's default) a restart round can hang in
  ``init_process_group`` (pytorch/pytorch#135712; see docs/guide/multi-host.md).

A worker's own failure (a one-line error of train.py, or a crash) restarts the group up to
``--max-restarts`` times, as under torchrun; then this prints torch's summary of the failed
ranks (without its traceback) and exits with the first failed rank's exit code (2 for a
user error, whose one line that rank printed above).
"""

from __future__ import annotations

import os
import re
import sys

from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from schnet_ipu.errors import UserError, configure_logging, run_cli

SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
TORCH_READ_TIMEOUT_S = 60  # c10d_rendezvous_backend's default read_timeout
TORCH_JOIN_TIMEOUT_S = 600  # dynamic_rendezvous's default join_timeout


class RendezvousError(UserError, ConnectionError):
    """This node could not join the nodes' rendezvous (the message names its endpoint)."""


def rdzv_setting(args, key: str, default: int) -> int:
    """A ``--rdzv-conf key=value`` setting as torch reads it (seconds), or its default."""
    for item in (args.rdzv_conf or "").split(","):
        name, _, value = item.partition("=")
        if name.strip() == key and value.strip():
            return int(value)
    return default


def socket_error(err: BaseException) -> str:
    """The socket error behind a store failure ("Network is unreachable", "Connection
    refused"), from the text of torch's error; '' when it names none."""
    found = re.findall(r"errno: \d+ - ([^)]+)\)", str(err.__cause__ or ""))
    return found[-1] if found else ""


def launch(argv: list[str]) -> int:
    """Parse torchrun's arguments and run its agent; rendezvous failures become
    :class:`RendezvousError`; returns the exit code."""
    args = torch_run.parse_args(argv)
    os.environ.setdefault(SHARE_STORE_VAR, "1")
    endpoint = args.rdzv_endpoint or "(no --rdzv-endpoint)"
    try:
        torch_run.run(args)
    except ChildFailedError as err:
        print(err.format_msg(), file=sys.stderr)
        code = err.get_first_failure()[1].exitcode
        return code if code > 0 else 1  # a signal (negative): failed all the same
    except RendezvousConnectionError as err:
        seconds = rdzv_setting(args, "read_timeout", TORCH_READ_TIMEOUT_S)
        detail = socket_error(err)
        raise RendezvousError(
            f"rendezvous {endpoint}: this node could not connect to the rendezvous store "
            f"within read_timeout={seconds} s{f' ({detail})' if detail else ''}; start the "
            "first node (it hosts the store, --rdzv-conf=is_host=true), check that this "
            f"host reaches {endpoint} (address, port, firewall), or raise --rdzv-conf "
            "read_timeout"
        ) from None
    except RendezvousTimeoutError:
        seconds = rdzv_setting(args, "join_timeout", TORCH_JOIN_TIMEOUT_S)
        raise RendezvousError(
            f"rendezvous {endpoint}: fewer than --nnodes={args.nnodes} nodes joined within "
            f"join_timeout={seconds} s; start the same command on every node of the job "
            "(same --rdzv-id and --rdzv-endpoint), or raise --rdzv-conf join_timeout"
        ) from None
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    return run_cli(lambda: launch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
