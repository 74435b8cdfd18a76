"""One chunk of K batches: its stacked tensors, the memory they are written into, and its
rows handed out as :class:`~schnet_ipu.batch.Batch` views.

The assembly (:mod:`schnet_ipu.feed.assembly`) fills an :class:`Assembled` chunk, whose tensors
:class:`ChunkOutputs` lays end to end in one buffer from :class:`OutputBuffers` (CPU
memory a loader reuses once no batch views it); :func:`unstack` cuts the chunk into Batches.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from schnet_ipu.batch import Batch


@dataclass
class Assembled:
    """K batches as stacked tensors; row k of every field is batch k (shapes of Batch)."""

    z: Tensor  # int64 [K, N]
    pos: Tensor  # float32 [K, N, 3]
    graph: Tensor  # int64 [K, N]
    node_mask: Tensor  # bool [K, N]
    y: Tensor  # float32 [K, G]
    graph_mask: Tensor  # bool [K, G]
    molecule_index: Tensor  # int64 [K, G]
    edge_index: Tensor | None  # int64 [K, 2, E]
    edge_mask: Tensor | None  # bool [K, E]
    forces: Tensor | None  # float32 [K, N, 3]
    edge_shift: Tensor | None = None  # int32 [K, E, 3] (periodic radius graphs)
    cell: Tensor | None = None  # float32 [K, G, 3, 3] (periodic stores)
    stress: Tensor | None = None  # float32 [K, G, 3, 3] (stores with stress)
    forces_mask: Tensor | None = None  # bool [K, G] (stores with partial forces)
    stress_mask: Tensor | None = None  # bool [K, G] (stores with partial stress)
    num_molecules: list[int] | None = None  # [K] real molecules per batch, when known on the host


def unstack(assembled: Assembled) -> list[Batch]:
    """Stacked batches -> one Batch per row (views, no copies), with the host molecule
    counts when known (so counting a device-resident batch never waits for the device)."""
    names = [name for name, value in vars(assembled).items() if isinstance(value, Tensor)]
    rows = zip(*(getattr(assembled, name).unbind(0) for name in names))
    batches = [Batch(**dict(zip(names, row))) for row in rows]
    for batch, count in zip(batches, assembled.num_molecules or []):
        batch.known_molecules = count
    return batches


class OutputBuffers:
    """CPU memory for assembled chunks, used again once the batches viewing it are gone.

    Each chunk's tensors are views of one byte buffer from here. A chunk is tens of MB: glibc
    serves such blocks from fresh kernel pages and often hands them back when they are freed,
    so without reuse a warm epoch took 20-60k page faults, and epochs with them ran 20-40%
    slower on the 2-core dev box. A buffer is handed out again only when no tensor viewing it
    is alive: the tensors' storage holds the only reference to a numpy view of the buffer,
    watched here by a weak reference, so batches a caller keeps are never overwritten.
    At most ``keep`` buffers are kept; past that, chunks get memory of their own. Loaders
    that take turns share one (a run's train, val and test loaders).

    Buffers are allocated by torch, not numpy: numpy asks the kernel for transparent huge
    pages, and once a process had allocated and freed a few hundred MB, filling a fresh
    80 MB numpy array stalled 0.15-0.23 s on the dev box (memory compaction), against a
    steady 0.06-0.07 s for torch's memory.
    """

    def __init__(self, keep: int = 0) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []  # uint8, kept for the whole run
        self._views: list[weakref.ref | None] = []  # the live view of each buffer, if any
        self._lock = threading.Lock()  # chunks are assembled on several threads

    def take(self, nbytes: int) -> Tensor:
        """uint8 [nbytes] that no live tensor views."""
        with self._lock:
            for k, buffer in enumerate(self._buffers):
                view = self._views[k]
                if len(buffer) >= nbytes and (view is None or view() is None):
                    return self._hand_out(k, nbytes)
            if len(self._buffers) < self.keep:
                self._buffers.append(torch.empty(nbytes, dtype=torch.uint8).numpy())
                self._views.append(None)
                return self._hand_out(len(self._buffers) - 1, nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def keep_at_least(self, count: int) -> None:
        """Keep up to ``count`` buffers (a loader's chunks alive at once)."""
        self.keep = max(self.keep, count)

    def _hand_out(self, k: int, nbytes: int) -> Tensor:
        view = self._buffers[k][:nbytes]  # a new array object: only the tensor will hold it
        self._views[k] = weakref.ref(view)
        return torch.from_numpy(view)

    def nbytes(self) -> int:
        return sum(len(buffer) for buffer in self._buffers)


class ChunkOutputs:
    """Output tensors of one chunk, laid end to end in one buffer (``buffers``), or each on
    its own (pinned for non-blocking copies to CUDA when ``pin``) without one."""

    ALIGN = 64  # bytes; every tensor starts on a cache line

    def __init__(
        self, nbytes: int, device: torch.device, pin: bool, buffers: OutputBuffers | None
    ) -> None:
        self.device, self.pin = device, pin and device.type == "cpu"
        use_buffers = buffers is not None and device.type == "cpu" and not self.pin
        slack = 16 * self.ALIGN  # room to align each of the (at most 15) tensors
        self.memory = buffers.take(nbytes + slack) if use_buffers else None
        self.used = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self.memory is None:
            return torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin)
        size = math.prod(shape) * _itemsize(dtype)
        start = self.used
        self.used = -(-(start + size) // self.ALIGN) * self.ALIGN
        return self.memory[start : start + size].view(dtype).view(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()  # (torch 2.0 has no dtype.itemsize)
