"""The loader: an epoch's host calls, from chunks of batches assembled a chunk at a time.

Batches are built a chunk (hundreds of batches) at a time by
:meth:`PackedDataset.assemble <schnet_ipu.feed.dataset.PackedDataset.assemble>` from the
split's flat arrays (:class:`~schnet_ipu.feed.arrays.FeedArrays`), on the CPU (by a compiled
loop when numba is installed, :mod:`schnet_ipu.feed.compiled`) or, when the data is
device-resident, on the training device; a batch is a row of the chunk. With ``workers >
0`` background threads assemble the next chunks while the step runs (the loop and the
gathers release the GIL, and nothing is pickled). A batch depends only on the seed, the
epoch and its index, never on the mode, the chunking or the thread that built it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from schnet_ipu.batch import Batch
from schnet_ipu.feed.chunk import Assembled, OutputBuffers, unstack
from schnet_ipu.feed.dataset import PackedDataset
from schnet_ipu.feed.layout import LoaderError

CHUNK_BYTES = 24 << 20  # output bytes assembled at once (~120 QM9 batches: fits the L3 cache)


class PackedLoader:
    """Iterates host calls (lists of ``micro_per_call`` Batches) over an epoch.

    ``workers = 0`` assembles chunks of batches only while the caller waits for them (never
    while a training step runs): on a CPU with several torch threads, one chunk per thread at
    once, each thread on its own chunk with one torch thread (the compiled loop runs on one
    core, and so do cumsum and the int32 gathers of the torch program whatever torch's thread
    count: this keeps every core busy). ``workers > 0`` background threads assemble up to
    ``max(prefetch, workers)`` chunks ahead, also while the step runs. ``pin_memory``: CPU
    chunks go to pinned memory (non-blocking copies to CUDA); otherwise to memory from
    ``buffers`` (its own when None), reused once no batch views it. Every batch is checked
    against the first batch's shapes.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        chunk_batches: int | None = None,
        buffers: OutputBuffers | None = None,
    ) -> None:
        self.dataset = dataset
        self.workers = workers
        self.ahead = max(prefetch, workers, 1)
        self.pin = pin_memory
        self.signature: tuple | None = None
        per_batch = dataset.arrays.batch_bytes(dataset.layout)
        self.chunk_batches = chunk_batches or max(1, CHUNK_BYTES // per_batch)
        on_cpu = dataset.arrays.device.type == "cpu"
        self.at_once = 1 if workers or not on_cpu else torch.get_num_threads()
        self.buffers = None  # pinned memory is reused by torch's allocator; CUDA memory too
        if on_cpu and not pin_memory:
            self.buffers = buffers if buffers is not None else OutputBuffers()
            # chunks alive at once: those being assembled or queued, and the one being read
            self.buffers.keep_at_least(self.ahead + self.at_once + 1)
        self._pool = None
        if workers:
            self._pool = ThreadPoolExecutor(workers, "feed")
        elif self.at_once > 1:
            self._pool = ThreadPoolExecutor(self.at_once, "feed", torch.set_num_threads, (1,))

    def __len__(self) -> int:
        """Host calls per epoch."""
        return self.dataset.calls_per_epoch

    def epoch(self, epoch: int, start_call: int = 0) -> Iterator[list[Batch]]:
        """Host calls of an epoch, from ``start_call`` on (a resumed epoch skips the rest)."""
        micro = self.dataset.layout.micro_per_call
        call: list[Batch] = []
        for chunk in self._chunks(epoch, start_call * micro):
            self.check_shape(chunk[0])  # the rows of a chunk share its shapes
            for batch in chunk:
                call.append(batch)
                if len(call) == micro:
                    yield call
                    call = []

    def _chunks(self, epoch: int, first: int) -> Iterator[list[Batch]]:
        """The epoch's batches from micro-batch ``first`` on, a chunk (list) at a time."""
        total = len(self.dataset)
        bounds = [
            (a, min(a + self.chunk_batches, total)) for a in range(first, total, self.chunk_batches)
        ]
        if self._pool is None:
            for a, b in bounds:
                yield unstack(self._assemble(epoch, a, b))
            return
        self.dataset.batch_order(epoch)  # worked out once here, not raced for by the threads
        if not self.workers:  # at_once chunks in parallel, all done before the caller goes on
            for i in range(0, len(bounds), self.at_once):
                futures = [
                    self._pool.submit(self._assemble, epoch, a, b)
                    for a, b in bounds[i : i + self.at_once]
                ]
                group = [unstack(future.result()) for future in futures]  # (then yield)
                del futures  # a finished future holds its chunk: the memory would stay busy
                while group:  # nor does this generator hold a chunk it has handed out
                    yield group.pop(0)
            return
        chunks = iter(bounds)
        pending: deque = deque()

        def submit() -> None:
            chunk = next(chunks, None)
            if chunk is not None:
                pending.append(self._pool.submit(self._assemble, epoch, *chunk))

        for _ in range(self.ahead):
            submit()
        while pending:
            assembled = pending.popleft().result()
            submit()
            yield unstack(assembled)

    def _assemble(self, epoch: int, first: int, stop: int) -> Assembled:
        return self.dataset.assemble(epoch, first, stop, self.pin, self.buffers)

    def check_shape(self, batch: Batch) -> None:
        signature = batch.signature()
        if self.signature is None:
            self.signature = signature
        elif signature != self.signature:
            raise LoaderError(
                f"batch shapes changed mid-run: {signature} != {self.signature}; "
                "fixed-shape batches are a contract of the loader"
            )
