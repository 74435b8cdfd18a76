"""The one replica runner: R spawned processes (a gloo group on CPU) that set up their variants
once, then run one on request in lockstep, timed by the interleaved timer like the in-process
ones (idle on a pipe meanwhile); balance's measurement is the setup, its rows the facts."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.multiprocessing as mp

from schnet_ipu.backends.distributed import shutdown_replica, spawn_replicas

# setup(rank, world, *args) -> (facts for the report, name -> call), run in every replica
Setup = Callable[..., "tuple[Any, dict[str, Callable[[], Any]]]"]


class Replicas(contextlib.AbstractContextManager):
    """``count`` replicas running ``setup(rank, count, *args)``; ``facts``: each rank's facts."""

    def __init__(self, count: int, setup: Setup, *args: object) -> None:
        ends = [mp.get_context("spawn").Pipe() for _ in range(count)]
        self.conns = [parent for parent, _ in ends]
        self.context = spawn_replicas(_serve, count, [child for _, child in ends], setup, args)
        self.facts = [self._receive(conn) for conn in self.conns]  # every replica is ready

    def step(self, name: str) -> Callable[[], int]:
        """A timer step: ``name`` on every replica, the molecules they trained together."""

        def call() -> int:
            for conn in self.conns:
                conn.send(name)
            return sum(self._receive(conn) for conn in self.conns)

        return call

    def __exit__(self, *exc: object) -> None:
        """Stop the replicas; re-raises a replica's error."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a replica that is gone: join reports why
                conn.send(None)
        while not self.context.join():
            pass

    def _receive(self, conn):
        while not conn.poll(0.5):
            if self.context.join(timeout=0):  # raises when a replica failed
                raise RuntimeError("the replicas exited before answering")
        return conn.recv()


def _serve(rank: int, conns: list, setup: Setup, args: tuple) -> None:
    """Replica ``rank``: set up, report the facts, then answer requests until ``None``."""
    conn = conns[rank]
    try:
        facts, calls = setup(rank, len(conns), *args)
        conn.send(facts)
        for name in iter(conn.recv, None):
            conn.send(calls[name]())
    finally:
        shutdown_replica()
