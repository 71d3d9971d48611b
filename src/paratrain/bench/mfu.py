"""Model FLOPs utilisation: the FLOPs of one training step, counted once, against the peak FLOP/s of the
devices that ran it.

    mfu = flops_per_step / median_step_s / (peak_flops_per_s_per_device x devices)

FLOPs: `torch.utils.flop_counter.FlopCounterMode` over one forward, loss and backward of the workload on
one global batch, on the meta device (shapes only, nothing computed). On meta,
`F.scaled_dot_product_attention` runs as its matrix products, so attention counts as forward plus twice
that for backward, with no flash-attention recomputation: model FLOPs, the same for every strategy and
device. Only matrix products and convolutions are counted (no norms, activations, softmax, optimizer).

Peak per device: on GPUs, NVIDIA's datasheet figure (dense, without sparsity) for the device name and the
precision the model's products run in (`TABLE`); on CPU workers, measured: each worker multiplies 1024 x
1024 matrices in the run's dtype on its one thread for half a second, all workers at once, and the best
rate is its peak (`measure_cpu`); the median over workers is the peak per device.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..measure.workloads import Workload

CONVOLUTIONS = ("aten.convolution", "aten.convolution_backward", "aten._convolution")

TABLE: list[tuple[str, str, dict[str, float]]] = [
    # (name contains, datasheet, TFLOP/s dense per dtype)
    ("H100 NVL", "NVIDIA H100 NVL datasheet", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H100 PCIe", "NVIDIA H100 PCIe datasheet", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", "NVIDIA H100 SXM5 datasheet", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H200 NVL", "NVIDIA H200 NVL datasheet", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H200", "NVIDIA H200 SXM datasheet", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("A100", "NVIDIA A100 datasheet", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
]
"""Dense tensor-core figures (the datasheets print twice these "with sparsity"); fp32 is the non-tensor-core
rate, which is what PyTorch's float32 matrix products run at unless TF32 is allowed."""


CPU_DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}
DTYPE_NAMES = {"32": "fp32", "bf16": "bf16", "16": "fp16"}


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    total: int | None
    """Model FLOPs of one training step on the global batch (None: could not be counted)."""
    kind: str
    """'matmul' or 'convolution': which units run most of them (it picks the fp32/TF32 peak on GPUs)."""
    method: str
    """How they were counted, or why not."""


@dataclass(frozen=True, kw_only=True)
class Peak:
    flops_per_s: float | None
    """Peak FLOP/s of one device (None: unknown, so no MFU)."""
    dtype: str
    source: str
    per_worker: list[float] | None = None
    """Measured peaks of each CPU worker (None on GPUs)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_step_flops(workload: Workload, batch: int, model: torch.nn.Module | None = None) -> StepFlops:
    """FLOPs of one forward + loss + backward of the workload on `batch` samples, counted on meta (`model`,
    if given, is moved there)."""
    try:
        model = (model if model is not None else workload.model()).to("meta")
        inputs, targets = (t.to("meta") for t in workload.data(batch))
        with FlopCounterMode(display=False) as counter:
            workload.loss()(model(inputs), targets).backward()
    except Exception as exc:  # a user model may not run on meta; the run goes on without MFU
        return StepFlops(total=None, kind="matmul", method=f"not counted: {type(exc).__name__}: {exc}"[:300])
    by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    total = counter.get_total_flops()
    conv = sum(n for op, n in by_op.items() if op in CONVOLUTIONS)
    return StepFlops(total=total or None, kind="convolution" if 2 * conv > total else "matmul",
                     method="torch.utils.flop_counter.FlopCounterMode, forward + backward of one global batch "
                            "on the meta device (matrix products and convolutions only)")


def gpu_dtype(precision: str, kind: str) -> str:
    """The dtype a CUDA step's products run in: AMP's dtype, or fp32 / TF32 as PyTorch's flags allow."""
    if precision != "32":
        return DTYPE_NAMES[precision]
    tf32 = torch.backends.cudnn.allow_tf32 if kind == "convolution" else torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def gpu_peak(name: str, precision: str, kind: str) -> Peak:
    dtype = gpu_dtype(precision, kind)
    for key, sheet, figures in TABLE:
        if key.lower() in name.lower():
            return Peak(flops_per_s=figures[dtype] * 1e12, dtype=dtype,
                        source=f"{sheet}: {figures[dtype]:g} TFLOP/s {dtype} dense, for {name!r}")
    return Peak(flops_per_s=None, dtype=dtype, source=f"no datasheet figure for GPU {name!r} in "
                                                      f"paratrain.bench.mfu.TABLE; MFU is not reported")


def measure_cpu(precision: str, seconds: float = 0.5, size: int = 1024) -> float:
    """Best FLOP/s of `size`-square matrix products on this process's threads (a worker has one)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(CPU_DTYPES[precision])
    b = torch.randn(size, size, generator=g).to(CPU_DTYPES[precision])
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end or best == 0.0:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def cpu_peak(workers: int, precision: str, timeout: float = 120.0) -> Peak:
    """Every worker measures its core at the same time, as they train (fresh processes, one thread each)."""
    from ..launcher.spawn import launch

    per_worker = [float(x) for x in launch(measure_cpu, precision, nproc=workers, all_ranks=True, timeout=timeout,
                                           accelerator="cpu", prefix_output=False)]
    dtype = DTYPE_NAMES[precision]
    return Peak(flops_per_s=sorted(per_worker)[len(per_worker) // 2], dtype=dtype,
                per_worker=[round(x, 1) for x in per_worker],
                source=f"measured: best {dtype} 1024x1024 matrix product on one thread, {workers} worker(s) "
                       f"at once, median over workers")
