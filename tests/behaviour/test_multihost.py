"""Training across hosts over a real network: torchrun nodes in network namespaces of this
machine joined by veth links (opt-in: ``pytest -m multihost``; root; skipped with one line
where network namespaces cannot be made).

Hosts A (10.213.0.1) and B (10.213.0.2) share a link; host C (10.213.1.2) sits on a second
link, to B only, with its default route through B, which does not forward: C cannot reach
A. Every node runs ``python -m schnet_ipu.backends.torchrun`` in its namespace, with the
c10d rendezvous on A's address, gloo over the link (``GLOO_SOCKET_IFNAME``) and
``--local-addr`` its own address (the namespaces share one hostname, so torchrun's default,
the hostname's address, would be nobody's here). The store and the run folders are on the
one disk every namespace sees, as on a cluster's shared file system; each rank reads its
share of the store (``loader.shard``) and records what it trained on
(``logging.seen_molecules``).

(a) two hosts of one process train exactly as one host of two (same world size and seed),
    at ``optim.lr`` at every step;
(b) every training molecule is trained on once per epoch over the hosts, each rank always
    from its own share;
(c) every process of host B SIGKILLed in epoch 1, then B started again (a replacement node):
    A's agent restarts the group (``--max-restarts``), the run resumes from the checkpoint
    of epoch 0 (at most one checkpoint interval lost) and the run folder holds every record
    and every epoch's molecule list once, with the uninterrupted run's values;
(d) host C ends within a bound with one line naming A's rendezvous address, exit code 2.

Every wait is bounded; the namespaces and every process in them go in a finalizer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from schnet_ipu.data import load_or_make_split
from tests.helpers import (
    ROOT,
    in_epoch_one,
    random_store,
    repo_env,
    run_outcome,
    smoke_overrides,
    wait_for,
    whole_records,
)

pytestmark = pytest.mark.multihost

IFACE = "mh0"  # every host's interface on the A-B link (names are per namespace)
MOLECULES, VAL, TEST, EPOCHS, LR = 400, 32, 32, 4, 1e-3
JOB_S = 240  # the longest any torchrun job may take here
READ_TIMEOUT_S = 5  # host C's bound on reaching the rendezvous store


class NamespaceError(RuntimeError):
    """An ``ip`` command that failed (no permission, no netns support)."""


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def kill_host(netns: str) -> None:
    """SIGKILL every process in ``netns`` (agents, workers, their helpers) until none is
    left (bounded)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", netns).split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    raise AssertionError(f"processes of {netns} survived SIGKILL for 30 s")


@dataclass(frozen=True)
class Host:
    netns: str
    address: str


class Network:
    """Network namespaces of this test run (named after its pid) and veth links between them."""

    def __init__(self) -> None:
        self.tag = f"mh{os.getpid()}"
        self.namespaces: list[str] = []
        self.veths: list[str] = []  # created in this (the root) namespace, then moved

    def namespace(self, name: str) -> str:
        netns = f"{self.tag}{name}"
        ip("netns", "add", netns)
        self.namespaces.append(netns)
        ip("-n", netns, "link", "set", "lo", "up")
        return netns

    def link(self, one: str, other: str, subnet: str, names: tuple[str, str]) -> None:
        """A veth pair from namespace ``one`` (``subnet``.1, interface ``names[0]``) to
        ``other`` (``subnet``.2, ``names[1]``)."""
        ends = (f"{self.tag}l{len(self.veths)}a", f"{self.tag}l{len(self.veths)}b")
        self.veths.append(ends[0])
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for end, netns, name, last in zip(ends, (one, other), names, (1, 2)):
            ip("link", "set", end, "netns", netns)
            ip("-n", netns, "link", "set", end, "name", name)
            ip("-n", netns, "addr", "add", f"{subnet}.{last}/24", "dev", name)
            ip("-n", netns, "link", "set", name, "up")

    def close(self) -> None:
        """Kill what runs in the namespaces, then delete them (their links go with them, and
        a veth pair a failed move left here is deleted here)."""
        for netns in self.namespaces:
            try:
                kill_host(netns)
            finally:
                subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        for veth in self.veths:  # gone with its namespace unless its move failed
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    """Hosts A and B on one link, C on a link to B only (its default route via B, which
    does not forward)."""
    if shutil.which("ip") is None:
        pytest.skip("multi-host test: no `ip` command (iproute2) here")
    if os.geteuid() != 0:
        pytest.skip("multi-host test: network namespaces need root")
    network = Network()
    try:
        try:
            a, b, c = (network.namespace(name) for name in "abc")
            network.link(a, b, "10.213.0", (IFACE, IFACE))
            network.link(b, c, "10.213.1", ("mh1", IFACE))
            ip("-n", c, "route", "add", "default", "via", "10.213.1.1")
            forwarding = ["ip", "netns", "exec", b, "sh", "-c"]
            subprocess.run([*forwarding, "echo 0 > /proc/sys/net/ipv4/ip_forward"], check=True)
        except (NamespaceError, subprocess.CalledProcessError) as err:
            pytest.skip(f"multi-host test: network namespaces not allowed here ({err})")
        yield {"a": Host(a, "10.213.0.1"), "b": Host(b, "10.213.0.2"), "c": Host(c, "10.213.1.2")}
    finally:
        network.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return random_store(tmp_path_factory.mktemp("multihost") / "store.h5", MOLECULES, seed=5)


def node(
    host: Host, endpoint: str, nnodes: int, nproc: int, run_dir: Path, store: Path, log: str
) -> subprocess.Popen:
    """One torchrun node in ``host``'s namespace, its output in ``log`` beside the run folder."""
    first = endpoint.startswith(host.address + ":")
    rdzv_conf = f"is_host={str(first).lower()},read_timeout={READ_TIMEOUT_S},join_timeout=120"
    command = [
        "ip", "netns", "exec", host.netns,
        sys.executable, "-m", "schnet_ipu.backends.torchrun",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--max-restarts=3",
        "--monitor-interval=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id=job-{run_dir.parent.name}", f"--rdzv-conf={rdzv_conf}",
        f"--local-addr={host.address}",
        str(ROOT / "train.py"),
        *smoke_overrides(
            store, run_dir, f"data.val={VAL}", f"data.test={TEST}", f"optim.epochs={EPOCHS}",
            f"optim.lr={LR}", "backend.replicas=2", "logging.log_every=1", "loader.shard=true",
            "logging.seen_molecules=true",
        ),
    ]  # fmt: skip
    output = (run_dir.parent / log).open("w")
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=repo_env(GLOO_SOCKET_IFNAME=IFACE),
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(nodes: list[subprocess.Popen], run_dir: Path) -> str:
    """Wait for every node (bounded), kill what overran; their logs, every node exit 0."""
    deadline = time.monotonic() + JOB_S
    for proc in nodes:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    logs = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(run_dir.parent.glob("*.log")))
    assert [p.returncode for p in nodes] == [0] * len(nodes), logs[-6000:]
    return logs


def folder_listing(run_dir: Path) -> list[str]:
    """Every file of a run folder, relative to it."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def seen(run_dir: Path) -> dict[str, np.ndarray]:
    """``logging.seen_molecules``'s files: name (eE.cC.rR) -> store indices."""
    return {p.stem: np.load(p) for p in sorted((run_dir / "seen").glob("*.npy"))}


@pytest.fixture(scope="module")
def one_host(hosts, store, tmp_path_factory) -> Path:
    """World size 2 on host A alone."""
    run_dir = tmp_path_factory.mktemp("one_host") / "run"
    endpoint = f"{hosts['a'].address}:29400"
    finish([node(hosts["a"], endpoint, 1, 2, run_dir, store, "a.log")], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def two_hosts(hosts, store, tmp_path_factory) -> Path:
    """World size 2 as hosts A and B of one process each."""
    run_dir = tmp_path_factory.mktemp("two_hosts") / "run"
    endpoint = f"{hosts['a'].address}:29401"
    nodes = [node(hosts[h], endpoint, 2, 1, run_dir, store, f"{h}.log") for h in "ab"]
    finish(nodes, run_dir)
    return run_dir


def test_two_hosts_train_as_one_host(one_host, two_hosts):
    want, got = run_outcome(one_host), run_outcome(two_hosts)
    assert got["kinds"] == want["kinds"] and got["kinds"].count("epoch") == EPOCHS
    for key in ("steps", "epochs", "final"):
        np.testing.assert_allclose(
            np.array(got[key], dtype=float), np.array(want[key], dtype=float), rtol=1e-6,
            err_msg=key,
        )  # fmt: skip
    # the learning rate is optim.lr at every step, whatever the world size (a constant
    # schedule): it is not scaled with the replicas
    assert {r["lr"] for r in whole_records(two_hosts) if r["kind"] == "step"} == {LR}


def test_every_training_molecule_once_per_epoch_across_hosts(two_hosts, store):
    train = load_or_make_split(store, MOLECULES, VAL, TEST, seed=0)["train"]
    files = seen(two_hosts)
    assert sorted(files) == [f"e{e}.c0.r{r}" for e in range(EPOCHS) for r in (0, 1)]
    for epoch in range(EPOCHS):
        both = np.concatenate([files[f"e{epoch}.c0.r{r}"] for r in (0, 1)])
        assert len(both) == len(train) and np.array_equal(np.sort(both), np.sort(train))
    for rank in (0, 1):  # a rank's share is the same every epoch, its order is not
        shares = [files[f"e{epoch}.c0.r{rank}"] for epoch in range(EPOCHS)]
        assert all(np.array_equal(np.sort(s), np.sort(shares[0])) for s in shares)
        assert not np.array_equal(shares[0], shares[1])


def test_a_lost_host_costs_at_most_one_checkpoint_interval(hosts, store, two_hosts, tmp_path):
    run_dir = tmp_path / "run"
    endpoint = f"{hosts['a'].address}:29402"
    nodes = [node(hosts[h], endpoint, 2, 1, run_dir, store, f"{h}.log") for h in "ab"]
    wait_for(lambda: in_epoch_one(run_dir), nodes, "a step of epoch 1", timeout_s=JOB_S)
    kill_host(hosts["b"].netns)  # B's agent, its worker and anything else of host B
    nodes[1].wait(timeout=30)
    nodes[1] = node(hosts["b"], endpoint, 2, 1, run_dir, store, "b-replacement.log")
    logs = finish(nodes, run_dir)
    got, want = run_outcome(run_dir), run_outcome(two_hosts)
    assert got["kinds"] == want["kinds"]  # every record exactly once
    for key in ("steps", "epochs", "final"):
        np.testing.assert_allclose(
            np.array(got[key], dtype=float), np.array(want[key], dtype=float), rtol=1e-6,
            err_msg=key,
        )  # fmt: skip
    # A's agent saw its worker fail and, ending 0 itself, restarted the group (--max-restarts)
    assert "failed (exitcode: " in (run_dir.parent / "a.log").read_text()
    assert "at epoch 1, host call 0" in logs  # resumed from epoch 0's checkpoint
    files, wanted = seen(run_dir), seen(two_hosts)
    assert sorted(files) == sorted(wanted)  # each epoch's molecule lists once
    assert all(np.array_equal(files[name], wanted[name]) for name in wanted)
    assert folder_listing(run_dir) == folder_listing(two_hosts)  # nothing more, nothing less


def test_a_host_that_cannot_reach_the_rendezvous_ends_with_one_line(hosts, store, tmp_path):
    run_dir = tmp_path / "run"
    endpoint = f"{hosts['a'].address}:29403"
    start = time.monotonic()
    proc = node(hosts["c"], endpoint, 2, 1, run_dir, store, "c.log")
    try:
        proc.wait(timeout=READ_TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - start
    last = (run_dir.parent / "c.log").read_text().strip().splitlines()[-1]
    assert proc.returncode == 2, last
    assert last.startswith(f"error: rendezvous {endpoint}: this node could not connect"), last
    assert f"within read_timeout={READ_TIMEOUT_S} s" in last
    assert seconds < READ_TIMEOUT_S + 60
