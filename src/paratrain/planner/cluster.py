"""What the planner knows about the hardware: a small spec, from a preset or a YAML/JSON file.

A cluster is `nodes` machines of `devices_per_node` identical devices. Each device has a peak rate per
precision, memory, and a memory bandwidth (the optimizer step is memory-bound); devices talk over an
intra-node link and an inter-node link, each an alpha-beta pair (latency, per-device bandwidth). The
efficiency curve says what fraction of peak one layer reaches for a given amount of work: small
matrix products run far below peak, large ones approach it. The file format (all keys but `name`
optional, units in the key names):

    name: my-cluster
    kind: cuda                       # cuda or cpu
    devices_per_node: 8
    nodes: 16
    device:
      peak_tflops: {"32": 67, bf16: 989}
      memory_gib: 80
      memory_bandwidth_gbps: 3350
    intra_node: {bandwidth_gbps: 360, latency_us: 3}
    inter_node: {bandwidth_gbps: 45, latency_us: 8}
    efficiency: [[1e9, 0.10], [1e11, 0.45], [1e13, 0.62]]   # [FLOPs of one layer call, fraction of peak]
    overlap: 1.0                     # share of communication that can hide behind compute
    reserved_gib: 2                  # memory the model cannot use (CUDA context, NCCL buffers)

`paratrain plan --cluster local` measures the machine at hand and writes it in this format, with the
fitted per-collective alpha-beta pairs under `collectives` (see `calibrate`): any of `COLLECTIVES`, e.g.

    collectives: {all_to_all: {alpha_us: 40, beta_s_per_gb: 0.9}}

A collective without a fitted pair (every one, in the presets) takes the link its group crosses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ParatrainError, unknown_name

GB = 1e9
GIB = 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""The collectives the alpha-beta model knows (`comm.py`); a spec's `collectives` may fit any of them."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of connection between two devices: time(n bytes) = latency + n / bandwidth."""

    bandwidth: float
    """Bytes per second one device can send (one direction)."""
    latency: float
    """Seconds of fixed cost per message (or per step of a ring)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    kind: str = "cuda"
    """"cuda" (one worker per GPU, nccl) or "cpu" (one single-threaded worker per core, gloo)."""
    devices_per_node: int = 1
    nodes: int = 1
    peak_flops: Mapping[str, float] = field(default_factory=dict)
    """FLOP/s of one device per precision ("32", "bf16", "16")."""
    memory: float = 0.0
    """Bytes of memory per device."""
    memory_bandwidth: float = 0.0
    """Bytes/s one device streams to and from its memory (bounds the optimizer step)."""
    intra: Link = Link(bandwidth=1e10, latency=1e-5)
    inter: Link = Link(bandwidth=1e10, latency=1e-5)
    efficiency: tuple[tuple[float, float], ...] = ((1.0, 0.5),)
    """(FLOPs of one layer call, fraction of peak it reaches), interpolated in log FLOPs."""
    overlap: float = 1.0
    """Share of communication time that can hide behind compute: 1 where a GPU computes while its copy
    engines and NIC move data, 0 for CPU workers whose one core also does the gloo transfers."""
    process_bytes: float = 0.0
    """Memory a worker process holds before any model state, as the measurement counts it (CPU: the
    resident size of a started worker; CUDA: 0, allocator statistics do not count the context)."""
    reserved: float = 0.0
    """Memory the model cannot use beyond `process_bytes` (CUDA context, NCCL buffers, fragmentation)."""
    action_overhead: float = 0.0
    """Seconds of runtime overhead per pipeline action (scheduling, sends, Python) not hidden by compute."""
    step_overhead: float = 0.0
    """Seconds paratrain's loop adds per `run.forward_backward` call beyond the model (hooks, wrappers):
    measured here, 0 on GPUs where the host runs ahead of the device."""
    tp_overhead: float = 0.0
    """Seconds one tensor-parallel (DTensor) Linear adds per forward and backward beyond its math and its
    all-reduce: sharding propagation and redistribution run in Python on every call. Measured here; 0 in specs."""
    expert_overhead: float = 0.0
    """Seconds one exchange of expert parallelism adds beyond its collectives (a listed expert's call, a grouped
    module's dispatch): the row counts agreed, the differentiable all-to-all's Python and autograd path, forward and
    backward. Measured here (`calibrate`); 0 in specs."""
    fsdp_unit: tuple[float, float] = (0.0, 0.0)
    """(seconds, seconds per parameter byte) one FSDP unit adds per forward and backward beyond its math and
    its collectives: hooks, flat-buffer copies, and on CPU workers the core its transfers take from compute.
    Measured here (`calibrate`); 0 in specs."""
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Fitted (alpha, beta) per collective on one node, when measured here; overrides the intra link."""
    measured_here: bool = False
    """True for the spec measured on this machine: layer times measured here apply as they are."""
    description: str = ""

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ParatrainError(f"cluster {self.name!r} gives no peak rate for precision {precision!r}; add it "
                                 f"under device.peak_tflops (it has {sorted(self.peak_flops)})")
        return float(self.peak_flops[precision])

    def efficiency_at(self, flops: float) -> float:
        """Fraction of peak one layer call of `flops` reaches (log-linear between the curve's points)."""
        points = sorted(self.efficiency)
        if flops <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if flops <= x1:
                w = (math.log(flops) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + w * (y1 - y0)
        return points[-1][1]

    def resized(self, devices: int) -> Cluster:
        """The same hardware with `devices` devices (whole nodes, or part of one)."""
        if devices <= self.devices_per_node:
            return replace(self, devices_per_node=devices, nodes=1)
        if devices % self.devices_per_node:
            raise ParatrainError(f"{devices} devices is not a whole number of {self.devices_per_node}-device nodes "
                                 f"of cluster {self.name!r}; use a multiple of {self.devices_per_node}")
        return replace(self, nodes=devices // self.devices_per_node)

    def as_spec(self) -> dict[str, Any]:
        """This cluster in the file format (what `load` reads back)."""
        spec: dict[str, Any] = {
            "name": self.name, "kind": self.kind, "description": self.description,
            "devices_per_node": self.devices_per_node, "nodes": self.nodes,
            "device": {"peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
                       "memory_gib": self.memory / GIB, "memory_bandwidth_gbps": self.memory_bandwidth / GB},
            "intra_node": _link_spec(self.intra), "inter_node": _link_spec(self.inter),
            "efficiency": [list(p) for p in self.efficiency], "overlap": self.overlap,
            "process_gib": self.process_bytes / GIB, "reserved_gib": self.reserved / GIB,
            "action_overhead_us": self.action_overhead * 1e6, "step_overhead_us": self.step_overhead * 1e6,
            "tp_overhead_us": self.tp_overhead * 1e6, "expert_overhead_us": self.expert_overhead * 1e6,
            "fsdp_unit_overhead": {"alpha_us": self.fsdp_unit[0] * 1e6, "beta_s_per_gb": self.fsdp_unit[1] * GB},
            "measured_here": self.measured_here,
        }
        if self.collectives:
            spec["collectives"] = {k: {"alpha_us": a * 1e6, "beta_s_per_gb": b * GB}
                                   for k, (a, b) in self.collectives.items()}
        return spec


def _link_spec(link: Link) -> dict[str, float]:
    return {"bandwidth_gbps": link.bandwidth / GB, "latency_us": link.latency * 1e6}


def _number(spec: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = spec.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ParatrainError(f"cluster spec: {where}{key} must be a non-negative number, got {value!r}")
    return float(value)


def _link(spec: Any, where: str, default: Link) -> Link:
    if spec is None:
        return default
    if not isinstance(spec, Mapping):
        raise ParatrainError(f"cluster spec: {where} must be a mapping with bandwidth_gbps and latency_us")
    bandwidth = _number(spec, "bandwidth_gbps", default.bandwidth / GB, f"{where}.") * GB
    if bandwidth <= 0:
        raise ParatrainError(f"cluster spec: {where}.bandwidth_gbps must be positive")
    return Link(bandwidth=bandwidth, latency=_number(spec, "latency_us", default.latency * 1e6, f"{where}.") * 1e-6)


def from_spec(spec: Mapping[str, Any]) -> Cluster:
    """A `Cluster` from the file format; every problem is named with the key to fix."""
    known = {"name", "kind", "description", "devices_per_node", "nodes", "device", "intra_node", "inter_node",
             "efficiency", "overlap", "process_gib", "reserved_gib", "action_overhead_us", "step_overhead_us",
             "tp_overhead_us", "expert_overhead_us", "fsdp_unit_overhead", "collectives", "measured_here"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ParatrainError(f"cluster spec: unknown key(s) {unknown}; known keys: {sorted(known)}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ParatrainError("cluster spec: give the cluster a name (name: my-cluster)")
    kind = spec.get("kind", "cuda")
    if kind not in ("cuda", "cpu"):
        raise ParatrainError(f"cluster spec: kind must be cuda or cpu, got {kind!r}")
    counts = {}
    for key in ("devices_per_node", "nodes"):
        value = spec.get(key, 1)
        if not isinstance(value, int) or value < 1:
            raise ParatrainError(f"cluster spec: {key} must be a positive integer, got {value!r}")
        counts[key] = value
    device = spec.get("device", {})
    if not isinstance(device, Mapping):
        raise ParatrainError("cluster spec: device must be a mapping (peak_tflops, memory_gib, ...)")
    peaks = device.get("peak_tflops", {})
    if not isinstance(peaks, Mapping) or not peaks:
        raise ParatrainError("cluster spec: device.peak_tflops must map precisions to TFLOP/s, e.g. {bf16: 989}")
    curve = spec.get("efficiency", [[1.0, 0.5]])
    if (not isinstance(curve, list) or not curve
            or not all(isinstance(p, list | tuple) and len(p) == 2 and 0 < p[1] <= 1 for p in curve)):
        raise ParatrainError("cluster spec: efficiency must be a list of [flops, fraction] pairs with 0 < fraction "
                             "<= 1, e.g. [[1e9, 0.1], [1e12, 0.6]]")
    collectives = {}
    for name, pair in (spec.get("collectives") or {}).items():
        if name not in COLLECTIVES:
            raise ParatrainError(f"cluster spec: collectives.{name} is not a collective the planner models; known: "
                                 f"{', '.join(COLLECTIVES)}")
        collectives[str(name)] = (_number(pair, "alpha_us", 0, f"collectives.{name}.") * 1e-6,
                                  _number(pair, "beta_s_per_gb", 0, f"collectives.{name}.") / GB)
    unit = spec.get("fsdp_unit_overhead") or {}
    if not isinstance(unit, Mapping):
        raise ParatrainError("cluster spec: fsdp_unit_overhead must be a mapping with alpha_us and beta_s_per_gb")
    overlap = _number(spec, "overlap", 1.0, "")
    if overlap > 1:
        raise ParatrainError(f"cluster spec: overlap is a share between 0 and 1, got {overlap}")
    intra = _link(spec.get("intra_node"), "intra_node", Link(bandwidth=1e10, latency=1e-5))
    return Cluster(
        name=spec["name"], kind=kind, description=str(spec.get("description", "")), **counts,
        peak_flops={str(k): _number(peaks, k, 0, "device.peak_tflops.") * 1e12 for k in peaks},
        memory=_number(device, "memory_gib", 0, "device.") * GIB,
        memory_bandwidth=_number(device, "memory_bandwidth_gbps", 0, "device.") * GB,
        intra=intra, inter=_link(spec.get("inter_node"), "inter_node", intra),
        efficiency=tuple((float(a), float(b)) for a, b in curve), overlap=overlap,
        process_bytes=_number(spec, "process_gib", 0, "") * GIB, reserved=_number(spec, "reserved_gib", 0, "") * GIB,
        action_overhead=_number(spec, "action_overhead_us", 0, "") * 1e-6,
        step_overhead=_number(spec, "step_overhead_us", 0, "") * 1e-6,
        tp_overhead=_number(spec, "tp_overhead_us", 0, "") * 1e-6, collectives=collectives,
        expert_overhead=_number(spec, "expert_overhead_us", 0, "") * 1e-6,
        fsdp_unit=(_number(unit, "alpha_us", 0, "fsdp_unit_overhead.") * 1e-6,
                   _number(unit, "beta_s_per_gb", 0, "fsdp_unit_overhead.") / GB),
        measured_here=bool(spec.get("measured_here", False)),
    )


def read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ParatrainError(f"{path} is YAML, which needs PyYAML: pip install 'paratrain[plan]' (or write the "
                                 "same keys as JSON)") from None
        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ParatrainError(f"{path} is not valid JSON ({exc}); fix it, or name it .yaml for YAML") from None
    if not isinstance(data, dict):
        raise ParatrainError(f"{path} must hold one mapping of cluster keys (name, devices_per_node, ...)")
    return data


# H100 SXM5 (NVIDIA H100 datasheet): 989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32 (PyTorch's default fp32
# matmul precision does not use TF32), 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 450 GB/s per direction; NCCL's
# measured all-reduce bus bandwidth on an 8-GPU NVSwitch node is about 360 GB/s. DGX H100 nodes have one
# 400 Gb/s InfiniBand NDR port per GPU (50 GB/s, about 45 GB/s achieved). The efficiency curve is eager
# PyTorch without fused kernels: a layer of a few GFLOPs is launch-bound, large transformer layers reach
# about 55% of peak (matrix products near 70%, normalisation and activations memory-bound).
_H100_DEVICE = {"peak_tflops": {"32": 67, "bf16": 989, "16": 989}, "memory_gib": 80 * GB / GIB,
                "memory_bandwidth_gbps": 3350}
_H100_EFFICIENCY = [[1e8, 0.02], [1e9, 0.08], [1e10, 0.25], [1e11, 0.38], [1e12, 0.43], [1e13, 0.45]]
PRESETS: dict[str, dict[str, Any]] = {
    "h100-nvlink": {
        "name": "h100-nvlink", "kind": "cuda", "description": "one node of 8 H100 SXM GPUs over NVLink/NVSwitch",
        "devices_per_node": 8, "nodes": 1, "device": _H100_DEVICE,
        "intra_node": {"bandwidth_gbps": 360, "latency_us": 3}, "inter_node": {"bandwidth_gbps": 45, "latency_us": 8},
        "efficiency": _H100_EFFICIENCY, "overlap": 1.0, "reserved_gib": 3,
    },
    "h100-ib": {
        "name": "h100-ib", "kind": "cuda",
        "description": "128 nodes of 8 H100 SXM GPUs: NVLink inside a node, 400 Gb/s InfiniBand per GPU between",
        "devices_per_node": 8, "nodes": 128, "device": _H100_DEVICE,
        "intra_node": {"bandwidth_gbps": 360, "latency_us": 3}, "inter_node": {"bandwidth_gbps": 45, "latency_us": 8},
        "efficiency": _H100_EFFICIENCY, "overlap": 1.0, "reserved_gib": 3,
    },
}
LOCAL = "local"
NAMES = (LOCAL, *PRESETS)


def load(name_or_path: str) -> Cluster:
    """A preset by name or a spec file (`local` is measured instead: see `comm.calibrate`)."""
    if name_or_path in PRESETS:
        return from_spec(PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ParatrainError(f"cluster spec file {path} does not exist; give a preset ({', '.join(NAMES)}) "
                                 "or a YAML/JSON file described in docs/plan.md")
        return from_spec(read_file(path))
    raise unknown_name("cluster preset", name_or_path, NAMES)


def write(cluster: Cluster, path: Path) -> Path:
    path.write_text(json.dumps(cluster.as_spec(), indent=1) + "\n")
    return path

