"""Gradient sums of CPU replicas on one host through a shared memory block.

On a small CPU host a gloo all-reduce costs milliseconds even for a few kilobytes: each
collective waits on several socket and thread wake-ups (between two processes on the 2-core
dev box: median 1.3 ms for 4 KB and 2.5 ms for the 364 KB gradient of the paper's SchNet,
p90 about 6 ms). Replicas that :func:`~schnet_ipu.backends.distributed.launch_replicas`
spawned on one host can do without sockets: each writes its flat gradient into its own row
of one shared block, they meet at a process barrier, and each sums the rows in rank order.
Every replica adds the same rows in the same order, so all get the same sum, bit for bit,
as from a collective.
"""

from __future__ import annotations

import os
import tempfile
import threading

import torch
import torch.distributed as dist
from torch import Tensor

from schnet_ipu.errors import ReplicaWaitError

SHARED_DIR = "/dev/shm"  # memory-backed on Linux; elsewhere the temporary directory


class SharedMemoryReduction:
    """Sums flat float32 buffers over the R replicas of one host.

    Args:
        barrier: a ``multiprocessing`` barrier for the R replica processes (made by the
            process that spawned them).
        rank, world_size: this replica's place among them.
        timeout_s: how long to wait for the other replicas before giving up.

    The block holds two sets of R rows of n values, used in turn: a replica writes step k+1's
    row only after every replica has reached step k's barrier, that is after each finished
    reading step k-1's rows, the set step k+1 reuses. So one barrier per step suffices. The
    block is a file in /dev/shm that rank 0 creates; it is unlinked as soon as every replica
    has mapped it, so nothing is left behind when the processes end, however they end.
    """

    def __init__(self, barrier, rank: int, world_size: int, timeout_s: float = 600.0) -> None:
        self.barrier = barrier
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.rows: Tensor | None = None  # [2, R, n] once the first buffer fixes n
        self.calls = 0

    def sum_(self, flat: Tensor) -> None:
        """Replace ``flat`` [n] (float32, CPU) by its sum over the replicas, in place."""
        rows = self._rows_for(flat.numel())[self.calls % 2]  # [R, n]
        self.calls += 1
        rows[self.rank].copy_(flat)
        try:
            self.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError as err:
            raise ReplicaWaitError(
                f"replica {self.rank}: the other replicas did not reach the gradient reduction "
                f"within {self.timeout_s:.0f} s"
            ) from err
        flat.copy_(rows[0])
        for row in rows[1:]:
            flat.add_(row)

    def _rows_for(self, numel: int) -> Tensor:
        """The shared [2, R, n] block, mapped by every replica at the first call (collective)."""
        if self.rows is not None:
            if self.rows.shape[2] != numel:
                raise ValueError(f"gradient size changed from {self.rows.shape[2]} to {numel}")
            return self.rows
        path = [None]
        if self.rank == 0:
            folder = SHARED_DIR if os.path.isdir(SHARED_DIR) else None
            handle, path[0] = tempfile.mkstemp(prefix="schnet-ipu-grads-", dir=folder)
            os.close(handle)
        dist.broadcast_object_list(path, src=0)
        size = 2 * self.world_size * numel
        block = torch.from_file(path[0], shared=True, size=size, dtype=torch.float32)
        dist.barrier()  # every replica has mapped the file: its name is no longer needed
        if self.rank == 0:
            os.unlink(path[0])
        self.rows = block.view(2, self.world_size, numel)
        return self.rows
