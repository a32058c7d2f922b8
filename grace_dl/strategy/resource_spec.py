"""The cluster a strategy is built for, in AutoDist's YAML resource-spec format::

    nodes:
      - address: 10.0.0.1
        gpus: [0, 1]            # or `slots: 2` (Horovod's processes per host)
        chief: true
        network_bandwidth: 25   # Gbit/s, as in AutoDist
      - address: 10.0.0.2
        gpus: [0, 1]
        network_bandwidth: 25
    network_latency_us: 30      # optional, per message (default 25)
    compression_throughput: compression_throughput.json   # optional: grace-dl strategy measure

Workers per node: ``slots`` when given, else the number of ``gpus``, else 1. The network
bandwidth of the job is the smallest node's (every ring passes through it); nodes without
``network_bandwidth`` count as 10 Gbit/s. AutoDist's ``cpus`` and ``ssh`` entries are accepted
and unused. A relative ``compression_throughput`` path is taken from the YAML file's folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grace_dl.validate import in_range

DEFAULT_BANDWIDTH_GBPS = 10.0
DEFAULT_LATENCY_US = 25.0
NODE_KEYS = ("address", "gpus", "cpus", "slots", "chief", "network_bandwidth", "ssh_config")
TOP_KEYS = ("nodes", "network_latency_us", "compression_throughput", "ssh")


@dataclass(frozen=True)
class NodeSpec:
    address: str
    workers: int
    gpus: tuple = ()
    chief: bool = False
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS

    def replicas(self) -> list[str]:
        """AutoDist-style replica names: ``address:GPU:i`` for GPUs, else ``address:CPU:i``."""
        if self.gpus and len(self.gpus) == self.workers:
            return [f"{self.address}:GPU:{g}" for g in self.gpus]
        return [f"{self.address}:CPU:{i}" for i in range(self.workers)]


@dataclass(frozen=True)
class ResourceSpec:
    nodes: tuple
    latency_s: float = DEFAULT_LATENCY_US * 1e-6
    throughput_path: str | None = None

    # ------------------------------------------------------------------ views
    @property
    def workers(self) -> int:
        return sum(n.workers for n in self.nodes)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return min(n.bandwidth_gbps for n in self.nodes) * 1e9 / 8

    @property
    def chief(self) -> NodeSpec:
        return next((n for n in self.nodes if n.chief), self.nodes[0])

    def replicas(self) -> list[str]:
        return [r for n in self.nodes for r in n.replicas()]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict, base_dir: Path | None = None) -> ResourceSpec:
        if not isinstance(data, dict):
            raise ValueError(f"a resource spec is a mapping with 'nodes', got {data!r}")
        unknown = sorted(set(data) - set(TOP_KEYS))
        if unknown:
            raise ValueError(f"unknown resource spec key(s) {unknown}; accepted: {list(TOP_KEYS)}")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise ValueError(f"resource spec 'nodes' must be a non-empty list, got {raw_nodes!r}")
        nodes = [_node(i, n) for i, n in enumerate(raw_nodes)]
        addresses = [n.address for n in nodes]
        dups = sorted({a for a in addresses if addresses.count(a) > 1})
        if dups:
            raise ValueError(f"resource spec lists node address(es) {dups} more than once")
        chiefs = [n.address for n in nodes if n.chief]
        if len(chiefs) > 1:
            raise ValueError(f"resource spec has {len(chiefs)} chiefs {chiefs}; at most one")
        latency_us = in_range("network_latency_us",
                              data.get("network_latency_us", DEFAULT_LATENCY_US), 0.0, None)
        throughput = data.get("compression_throughput")
        if throughput is not None:
            if not isinstance(throughput, str):
                raise ValueError(f"compression_throughput must be a path, got {throughput!r}")
            if base_dir is not None and not Path(throughput).is_absolute():
                throughput = str(Path(base_dir) / throughput)
        return cls(tuple(nodes), latency_us * 1e-6, throughput)

    @classmethod
    def from_yaml(cls, path) -> ResourceSpec:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"resource spec file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"resource spec {str(path)!r} is not valid YAML: {err}") from None
        return cls.from_dict(data, base_dir=path.parent)

    @classmethod
    def local(cls, workers: int, bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS,
              latency_us: float = DEFAULT_LATENCY_US) -> ResourceSpec:
        """One host with ``workers`` processes (handy for tests and quick builds)."""
        workers = in_range("workers", workers, 1, None, kind=int)
        bandwidth = in_range("bandwidth_gbps", bandwidth_gbps, 0.0, None, lo_open=True)
        latency = in_range("latency_us", latency_us, 0.0, None)
        return cls((NodeSpec("localhost", workers, chief=True, bandwidth_gbps=bandwidth),),
                   latency * 1e-6)

    @classmethod
    def coerce(cls, spec) -> ResourceSpec | None:
        """``None``, a ``ResourceSpec``, a dict, or a path to a YAML file."""
        if spec is None or isinstance(spec, ResourceSpec):
            return spec
        if isinstance(spec, dict):
            return cls.from_dict(spec)
        if isinstance(spec, (str, Path)):
            return cls.from_yaml(spec)
        raise ValueError(f"resource spec must be a ResourceSpec, a dict or a YAML path, "
                         f"got {type(spec).__name__}")


def _node(i: int, raw) -> NodeSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"resource spec node {i} must be a mapping, got {raw!r}")
    unknown = sorted(set(raw) - set(NODE_KEYS))
    if unknown:
        raise ValueError(f"resource spec node {i}: unknown key(s) {unknown}; accepted: "
                         f"{list(NODE_KEYS)}")
    address = raw.get("address")
    if not isinstance(address, str) or not address:
        raise ValueError(f"resource spec node {i} needs an 'address' string, got {address!r}")
    gpus = raw.get("gpus", [])
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        gpus = list(range(gpus))
    if not isinstance(gpus, list) or not all(isinstance(g, int) for g in gpus):
        raise ValueError(f"node {address!r}: gpus must be a list of device indices, got {gpus!r}")
    if "slots" in raw:
        workers = in_range(f"node {address!r} slots", raw["slots"], 1, None, kind=int)
    else:
        workers = max(1, len(gpus))
    bandwidth = in_range(f"node {address!r} network_bandwidth",
                         raw.get("network_bandwidth", DEFAULT_BANDWIDTH_GBPS), 0.0, None,
                         lo_open=True)
    chief = raw.get("chief", False)
    if not isinstance(chief, bool):
        raise ValueError(f"node {address!r}: chief must be true or false, got {chief!r}")
    return NodeSpec(address, workers, tuple(gpus), chief, bandwidth)
