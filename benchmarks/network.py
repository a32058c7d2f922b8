"""Emulated hosts on one machine: network namespaces, veth pairs, a bridge, shaped links.

    with EmulatedCluster(n_hosts=2, mbit=100) as cluster:
        subprocess.run(cluster.horovodrun(["python", "train.py"]), env=cluster.env())
        # torch.distributed: one torchrun per host, started together (benchmarks/ddp.py)
        procs = [subprocess.Popen(c, env=cluster.env()) for c in cluster.torchrun(["train.py"])]

Topology: a switch namespace holds a Linux bridge; each host namespace has one ``eth0`` (a veth
whose peer is a bridge port) with address ``10.77.<id>.<i+1>/24``. Each link is shaped in both
directions with a token bucket (``tc qdisc ... tbf``): the host's ``eth0`` egress (upload) and
the bridge port's egress (download). Only these namespaces' addresses are ever used; nothing
touches the root namespace's interfaces, routes or addresses.

Delay: this kernel has no ``sch_netem``, so only bandwidth is emulated (``delay_ms`` must be 0
here; a kernel with netem would add ``netem delay`` under the token bucket).

``horovodrun`` and ``mpirun`` reach the "remote" hosts through ``benchmarks/fake_ssh``, which
runs a command in the namespace of the host address it is given. The launcher itself runs inside
host 0's namespace so that its rendezvous server is reachable from every host.

CPU: with ``bind`` (the default), every rank starts through ``benchmarks/bind.py`` and runs on
cores of its own, as a rank on a host of its own would; ``bind=False`` leaves the ranks to the
scheduler on the shared cores (every emulated run before the binding was).

Namespaces are removed on exit, on Ctrl-C / SIGTERM and on failure; ``cleanup_stale()`` removes
leftovers of a run that was killed hard.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from benchmarks.bind import command as bind_command

HERE = Path(__file__).resolve().parent
FAKE_SSH_DIR = HERE / "fake_ssh_bin"
PREFIX = "gracebench"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _tc(ns, *args):
    subprocess.run(["tc", "-n", ns, *args], check=True, capture_output=True, text=True)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with ``prefix`` (leftovers of a killed run)."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in out:
        name = line.split(" ")[0].strip()
        if name.startswith(prefix):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            removed.append(name)
    return removed


def _shape(ns: str, dev: str, mbit: float) -> None:
    # burst must hold at least one MTU-size packet per timer tick; 1/100 s of traffic is ample.
    burst = max(32 * 1024, int(mbit * 1e6 / 8 / 100))
    _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
        "burst", str(burst), "latency", "400ms")


class EmulatedCluster:
    def __init__(self, n_hosts: int = 2, mbit: float = 1000.0, delay_ms: float = 0.0,
                 subnet_id: int = 77, prefix: str = PREFIX, bind: bool = True):
        if n_hosts < 2:
            raise ValueError(f"n_hosts must be >= 2, got {n_hosts}")
        if not 0 < mbit <= 100_000:
            raise ValueError(f"mbit must be in (0, 100000], got {mbit}")
        if delay_ms != 0:
            raise ValueError("delay_ms must be 0: this kernel has no sch_netem to add delay")
        if os.geteuid() != 0:
            raise PermissionError("emulated hosts need root (ip netns, tc)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"'{tool}' not found: install Debian's iproute2")
        self.n_hosts, self.mbit, self.prefix, self.bind = n_hosts, float(mbit), prefix, bind
        self.switch = f"{prefix}-sw"
        self.namespaces = [f"{prefix}-h{i}" for i in range(n_hosts)]
        self.addresses = [f"10.{subnet_id}.0.{i + 1}" for i in range(n_hosts)]
        self._up = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        self.create()
        return self

    def __exit__(self, *exc):
        self.destroy()

    def create(self) -> None:
        cleanup_stale(self.prefix)
        atexit.register(self.destroy)
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                self.destroy()
                if callable(previous):
                    previous(signum, frame)
                sys.exit(128 + signum)

            signal.signal(sig, handler)
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        self._up = True

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            # IPv4 only: Gloo takes the first address of the interface it is given, and an
            # IPv6 link-local one there breaks its connections.
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                            "net.ipv6.conf.all.disable_ipv6=1"], check=False)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Every namespace shares this machine's hostname, which /etc/hosts maps to
            # 127.0.0.1; Gloo advertises the address its hostname resolves to for some of its
            # contexts. `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts, so each
            # emulated host resolves the hostname to its own eth0 address.
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")
            # Create the pair inside the host namespace so no name lands in the root namespace.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}",
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
        self.set_bandwidth(self.mbit)

    def set_bandwidth(self, mbit: float) -> None:
        """Re-shape every link (both directions) to ``mbit`` Mbit/s."""
        self.mbit = float(mbit)
        for i, ns in enumerate(self.namespaces):
            _shape(ns, "eth0", self.mbit)
            _shape(self.switch, f"p{i}", self.mbit)

    def destroy(self) -> None:
        for ns in [*self.namespaces, self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._up = False

    # ------------------------------------------------------------------ launching
    def env(self, base: dict | None = None) -> dict:
        """Environment for a launcher: fake ssh first on PATH, host->namespace map."""
        env = dict(os.environ if base is None else base)
        FAKE_SSH_DIR.mkdir(exist_ok=True)
        link = FAKE_SSH_DIR / "ssh"
        if not link.exists():
            link.symlink_to(HERE / "fake_ssh")
        env["PATH"] = f"{FAKE_SSH_DIR}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}" \
                      f"{env.get('PATH', '')}"
        env["GRACE_NETNS_MAP"] = ",".join(f"{a}={n}" for a, n in zip(self.addresses,
                                                                      self.namespaces))
        return env

    def in_host(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def horovodrun(self, argv: list[str], slots: int = 1) -> list[str]:
        """``horovodrun --gloo`` across the hosts, one or more ranks per host."""
        hosts = ",".join(f"{a}:{slots}" for a in self.addresses)
        return self.in_host(0, [str(Path(sys.executable).parent / "horovodrun"),
                                "-np", str(self.n_hosts * slots), "-H", hosts, "--gloo",
                                "--network-interface", "eth0", *self._bound(argv)])

    def _bound(self, argv: list[str]) -> list[str]:
        return bind_command(argv) if self.bind else list(argv)

    def torchrun(self, argv: list[str], port: int = 29511, nproc: int = 1) -> list[list[str]]:
        """One ``torchrun`` per host (static rendezvous on host 0's address), ``nproc`` ranks
        each: start them all, then wait for them all. Set ``GLOO_SOCKET_IFNAME=eth0``.
        ``argv`` is a script and its arguments."""
        launcher = str(Path(sys.executable).parent / "torchrun")
        if self.bind:  # torchrun runs the binding module, which then runs the script
            argv = ["-m", "benchmarks.bind", sys.executable, *argv]
        return [self.in_host(i, [launcher, f"--nnodes={self.n_hosts}", f"--node-rank={i}",
                                 f"--nproc-per-node={nproc}",
                                 f"--master-addr={self.addresses[0]}", f"--master-port={port}",
                                 *argv])
                for i in range(self.n_hosts)]

    def mpirun(self, argv: list[str], slots: int = 1) -> list[str]:
        """Open MPI's ``mpirun`` across the hosts (TCP over eth0 only)."""
        hosts = ",".join(f"{a}:{slots}" for a in self.addresses)
        return self.in_host(0, [shutil.which("mpirun") or "mpirun", "--allow-run-as-root",
                                "-np", str(self.n_hosts * slots), "-H", hosts,
                                "--mca", "plm_rsh_agent", str(HERE / "fake_ssh"),
                                "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include",
                                "eth0", "--mca", "oob_tcp_if_include", "eth0",
                                "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
                                "-x", "PATH", "-x", "PYTHONPATH",
                                "-x", "GRACE_NETNS_MAP", *self._bound(argv)])
